"""The plan command's option values, read from the command line: sizes, pins and the disk tier,
the topology, the precisions and wire dtypes the planner may choose, the replica counts. Each
refuses a malformed value with a one-line UsageError naming the option."""

from __future__ import annotations

import argparse
import math
import re

import torch

from manualpar import EmbeddingInputError, ManualParError, PlanError
from manualpar.embeddings import (
    DiskTier,
    EmbeddingBagConfig,
    TablePlacement,
    data_parallel,
    row_wise,
    table_wise,
)
from manualpar.embeddings.planning import (
    PlanConstraints,
    Topology,
    default_topology,
    load_topology,
    table_dtype,
)

__all__ = [
    "PIN_PLACEMENTS",
    "UsageError",
    "bags_per_feature_of",
    "disk_options",
    "parse_bytes",
    "precisions_of",
    "replica_choices",
    "topology_of",
    "wire_dtypes_of",
]

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


PIN_PLACEMENTS = {
    "disk": row_wise(on_disk=True),
    "row_wise": row_wise(),
    "data_parallel": data_parallel(),
}


class UsageError(ManualParError, ValueError):
    """The command line itself is wrong (a malformed --table, an unknown --plan or size)."""


def parse_bytes(text: str, option: str = "--memory-budget") -> int:
    """'2GiB', '512MiB', '1.5GB' or plain bytes -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in UNITS or float(match.group(1)) <= 0:
        raise UsageError(
            f"{option} {text!r}: expected a positive size such as 2GiB, "
            "512MiB, 1.5GB or plain bytes"
        )
    return int(float(match.group(1)) * UNITS[unit])


def disk_options(
    args: argparse.Namespace,
) -> tuple[DiskTier | None, dict[str, TablePlacement]]:
    """--disk-cache and --pin: the disk tier the job would pass (its directory is not used to
    plan) and the pinned placements."""
    tier = None
    if args.disk_cache is not None:
        tier = DiskTier(".", cache_bytes=parse_bytes(args.disk_cache, "--disk-cache"))
    pinned = {}
    for spec in args.pin:
        name, _, kind = spec.partition("=")
        placement = PIN_PLACEMENTS.get(kind)
        if kind.startswith("table_wise:") and kind[len("table_wise:") :].isdigit():
            placement = table_wise(int(kind[len("table_wise:") :]))
        if not name or placement is None:
            raise UsageError(
                f"--pin {spec!r}: expected TABLE=PLACEMENT with PLACEMENT one of "
                f"{', '.join(PIN_PLACEMENTS)} or table_wise:RANK, e.g. --pin ads=disk"
            )
        pinned[name] = placement
    return tier, pinned


def bags_per_feature_of(
    args: argparse.Namespace, tables: list[EmbeddingBagConfig], batch: int
) -> dict[str, float]:
    """--bags-per-feature user=64 (repeat, or user=64,hist=8): a batch per feature's bags a rank
    sends per step, by feature (PlanOptions.bags_per_feature); the features left out have one
    bag per sample. A count is at most the batch: a rank's samples read its bags."""
    known = [f for table in tables for f in table.feature_names]
    bags: dict[str, float] = {}
    for spec in (part for value in args.bags_per_feature for part in value.split(",") if part):
        feature, equals, text = spec.partition("=")
        if not feature or not equals:
            raise UsageError(
                f"--bags-per-feature {spec!r}: expected FEATURE=BAGS, the bags one rank sends "
                "per step for that feature, e.g. --bags-per-feature user=64"
            )
        try:
            count = float(text)
        except ValueError:
            count = math.nan
        if not (math.isfinite(count) and 0 <= count <= batch):
            raise UsageError(
                f"--bags-per-feature {spec!r}: feature {feature!r} needs a number of bags from 0 "
                f"to the batch per rank ({batch}), got {text!r}: the bags one rank sends per "
                "step for it (its samples read them)"
            )
        if feature not in known:
            raise UsageError(
                f"--bags-per-feature {spec!r}: no table has feature {feature!r}; the features "
                f"are {', '.join(known)}"
            )
        if feature in bags:
            raise UsageError(f"--bags-per-feature: feature {feature!r} is given twice")
        bags[feature] = count
    return bags


def topology_of(args: argparse.Namespace) -> Topology:
    if args.topology is None:  # as before topologies: all ranks on one node unless told
        return default_topology(args.world_size, args.ranks_per_node or args.world_size)
    try:
        return load_topology(args.topology, args.world_size, args.ranks_per_node)
    except ManualParError as error:
        raise UsageError(f"--topology: {error}") from None


def precisions_of(args: argparse.Namespace) -> tuple[torch.dtype, ...]:
    """--precisions fp32,bf16: the row dtypes the planner may give a table, most precise first."""
    if not args.precisions:
        return ()
    if args.plan != "auto":
        raise UsageError("--precisions: only --plan auto chooses precisions")
    try:
        return tuple(table_dtype(name) for name in args.precisions.split(",") if name)
    except EmbeddingInputError as error:
        raise UsageError(f"--precisions: {error}") from None


def wire_dtypes_of(args: argparse.Namespace) -> tuple[str, ...]:
    """--wire-dtypes fp32,bf16: the exchanges' dtypes the planner may choose from."""
    if not args.wire_dtypes:
        return ()
    if args.plan != "auto":
        raise UsageError("--wire-dtypes: only --plan auto prices the exchanges' dtypes")
    names = tuple(name for name in args.wire_dtypes.split(",") if name)
    try:
        PlanConstraints(wire_dtypes=names)
    except PlanError as error:
        raise UsageError(f"--wire-dtypes: {error}") from None
    return names


def replica_choices(text: str, topology: Topology) -> list[int]:
    """--replicas: one count, or "auto": every count that splits the job into shard groups of
    whole nodes (or of equal parts of one), up to 8."""
    world, per_node = topology.world_size, topology.ranks_per_node

    def fits(replicas: int) -> bool:
        shard = world // replicas
        return world % replicas == 0 and (shard % per_node == 0 or per_node % shard == 0)

    if text == "auto":
        return [r for r in (1, 2, 4, 8) if r <= world and fits(r)]
    if not text.isdigit() or int(text) < 1 or not fits(int(text)):
        raise UsageError(
            f"--replicas {text!r}: expected auto or a count that divides --world-size {world} "
            f"into shard groups of whole nodes ({per_node} ranks) or of equal parts of one"
        )
    return [int(text)]
