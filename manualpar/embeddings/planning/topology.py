"""The machine a plan is for: ranks, nodes, memory and the speeds of memory, links and disk.

    topology = load_topology("h100-nvlink-ndr", world_size=1024)   # a preset, 8 ranks a node
    topology = load_topology("topology.json", world_size=4)        # `python -m manualpar calibrate`

The cost model (cost_model.py) turns a plan's bytes, rows and collectives into seconds with
these numbers. Presets for GPU nodes are the vendors' datasheet peaks (see TOPOLOGY_PRESETS): a real
all_to_all reaches a fraction of them, so their predicted times are lower bounds and their use is
to rank plans, not to promise a step time. The CPU preset was measured on the project's 2-core
test machine by the calibration command; measure your own host the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from manualpar.errors import PlanError

__all__ = ["TOPOLOGY_PRESETS", "Topology", "load_topology"]

GB = 10**9
GiB = 2**30
COUNTS = ("world_size", "ranks_per_node", "cores_per_node")  # the fields that count, not measure
REMEASURE = "measure the host with `python -m manualpar calibrate --out FILE`"


def _finite_number(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)  # (a huge int is finite, not a float)


@dataclass(frozen=True)
class Topology:
    """Per-rank resources of a job of `world_size` ranks, `ranks_per_node` to a node.

    Bandwidths are bytes per second per rank and direction; latencies are seconds per
    collective. `row_seconds` is the fixed cost of touching one row in memory (a random access,
    beyond its bytes at `memory_bandwidth`); `disk_row_seconds` the same for one row read from or
    written to disk (a system call on a page the cache missed); `block_seconds` the fixed cost
    of one table block in a step, whatever its size (launching its lookup, gradient and update
    kernels, and their bookkeeping). `cores_per_node` matters for CPU jobs with more ranks than
    cores on a node: they share them (0: a GPU each, nothing shared).
    """

    name: str
    world_size: int
    ranks_per_node: int
    device_memory_bytes: int
    host_memory_bytes: int
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    disk_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float
    row_seconds: float
    disk_row_seconds: float
    block_seconds: float
    cores_per_node: int = 0  # CPU jobs: cores the node's ranks share (0: each rank has its own)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "name":
                continue
            # a NaN or an infinite speed would price every plan alike ("nan ms" on every rank)
            if not _finite_number(value) or value < 0:
                raise PlanError(
                    f"topology {self.name!r}: {field.name} must be a finite number >= 0, got "
                    f"{value!r}; {REMEASURE}"
                )
            if field.name in COUNTS and not isinstance(value, int):
                raise PlanError(
                    f"topology {self.name!r}: {field.name} must be a whole number, got {value!r}"
                )
        if self.world_size < 1 or self.ranks_per_node < 1:
            raise PlanError(
                f"topology {self.name!r}: world_size ({self.world_size}) and ranks_per_node "
                f"({self.ranks_per_node}) must be >= 1"
            )
        if self.world_size % self.ranks_per_node:
            raise PlanError(
                f"topology {self.name!r}: ranks_per_node={self.ranks_per_node} must divide "
                f"world_size={self.world_size} (nodes of equal size); pass --ranks-per-node"
            )
        for name in ("memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            if getattr(self, name) <= 0:
                raise PlanError(f"topology {self.name!r}: {name} must be > 0")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def with_world(self, world_size: int, ranks_per_node: int | None = None) -> Topology:
        """The same hardware for another job size (ranks per node kept unless given, and at
        most the world size)."""
        per_node = ranks_per_node or min(self.ranks_per_node, world_size)
        return dataclasses.replace(self, world_size=world_size, ranks_per_node=per_node)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# Hardware only: world_size and ranks_per_node come from the job. Sources:
# - GPU nodes: NVIDIA DGX A100 / DGX H100 datasheets (HBM capacity and bandwidth; NVLink's total
#   bidirectional bandwidth per GPU, halved for one direction; one 200 Gb/s HDR or 400 Gb/s NDR
#   InfiniBand port per GPU; 2 TB of host memory and NVMe RAID read speed per node, shared by 8).
#   Latencies are typical NCCL small-message all_to_all times, and block_seconds a few kernel
#   launches (about 5 us each) per block: assumptions.
# - "cpu-host": the project's 2-core test machine (gloo over loopback, local SSD), measured by
#   `python -m manualpar calibrate` (docs/launch.md has the command, docs/benchmarks.md its runs).
TOPOLOGY_PRESETS: dict[str, dict[str, Any]] = {
    "a100-nvlink-hdr": {
        "ranks_per_node": 8,
        "device_memory_bytes": 80 * GiB,
        "host_memory_bytes": 2000 * GB // 8,
        "memory_bandwidth": 2039 * GB,
        "intra_node_bandwidth": 300 * GB,
        "inter_node_bandwidth": 25 * GB,
        "disk_bandwidth": 25 * GB / 8,
        "intra_node_latency": 20e-6,
        "inter_node_latency": 50e-6,
        "row_seconds": 0.0,
        "disk_row_seconds": 20e-6,
        "block_seconds": 30e-6,
    },
    "h100-nvlink-ndr": {
        "ranks_per_node": 8,
        "device_memory_bytes": 80 * GiB,
        "host_memory_bytes": 2000 * GB // 8,
        "memory_bandwidth": 3350 * GB,
        "intra_node_bandwidth": 450 * GB,
        "inter_node_bandwidth": 50 * GB,
        "disk_bandwidth": 50 * GB / 8,
        "intra_node_latency": 15e-6,
        "inter_node_latency": 40e-6,
        "row_seconds": 0.0,
        "disk_row_seconds": 20e-6,
        "block_seconds": 30e-6,
    },
    "cpu-host": {  # medians of 3 calibrations on an idle machine (docs/benchmarks.md)
        "ranks_per_node": 2,
        "device_memory_bytes": 11922583552,
        "host_memory_bytes": 11922583552,
        "memory_bandwidth": 21.3e9,
        "intra_node_bandwidth": 0.53e9,
        "inter_node_bandwidth": 0.53e9,
        "disk_bandwidth": 2.5e9,
        "intra_node_latency": 370e-6,
        "inter_node_latency": 370e-6,
        "row_seconds": 169e-9,
        "disk_row_seconds": 63e-6,
        "block_seconds": 78e-6,
        "cores_per_node": 2,
    },
}


def load_topology(
    name_or_path: str | Path, world_size: int, ranks_per_node: int | None = None
) -> Topology:
    """A preset by name (TOPOLOGY_PRESETS) or a JSON file of Topology's fields (world_size and
    ranks_per_node in the file are used unless given here)."""
    text = str(name_or_path)
    if text in TOPOLOGY_PRESETS:
        fields: Mapping[str, Any] = {"name": text, **TOPOLOGY_PRESETS[text]}
    else:
        path = Path(text)
        if not path.is_file():
            raise PlanError(
                f"topology {text!r} is neither a preset ({', '.join(TOPOLOGY_PRESETS)}) nor a "
                "file; make one with `python -m manualpar calibrate --out topology.json`"
            )
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise PlanError(f"topology file {path}: cannot read its JSON: {error}") from None
        if not isinstance(fields, dict):
            raise PlanError(f"topology file {path}: expected a JSON object of Topology's fields")
        fields = {"name": path.stem, **fields}
    known = {f.name for f in dataclasses.fields(Topology)}
    unknown = sorted(set(fields) - known)
    optional = {"world_size", "ranks_per_node", "cores_per_node"}
    missing = sorted(known - optional - set(fields))
    if unknown or missing:
        raise PlanError(
            f"topology {text!r}: unknown fields {unknown}, missing fields {missing}; the fields "
            f"are {sorted(known)}"
        )
    fields = dict(fields)
    fields["world_size"] = world_size
    per_node = fields.get("ranks_per_node", world_size)
    if isinstance(per_node, int) and not isinstance(per_node, bool):  # else Topology says why
        per_node = min(per_node, world_size)
    fields["ranks_per_node"] = ranks_per_node or per_node
    return Topology(**fields)
