"""Cluster environments: turn launcher variables into rank information.

No torch.distributed calls happen here; this module only reads a mapping of environment variables,
so every launcher (torchrun/torchelastic/torchx, SLURM, OpenMPI, a plain single process) can be
tested by passing a dict.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from manualpar.errors import ClusterEnvironmentError

__all__ = [
    "ClusterEnvironment",
    "detect_environment",
    "from_mpi",
    "from_slurm",
    "from_torchelastic",
    "single_process",
]


@dataclass(frozen=True)
class ClusterEnvironment:
    """Where this process sits in the job. Construct one directly to override detection."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    source: str = "user"
    # torchrun's agent already hosts the rendezvous store; workers must join it, not create one.
    uses_agent_store: bool = False

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def validate(self) -> None:
        """Raise ClusterEnvironmentError naming the inconsistent fields."""
        names = _FIELD_NAMES.get(self.source, {})

        def name(field: str) -> str:
            return names.get(field, field)

        problems = []
        if self.world_size < 1:
            problems.append(f"{name('world_size')}={self.world_size} must be >= 1")
        if not 0 <= self.rank < max(self.world_size, 1):
            problems.append(
                f"{name('rank')}={self.rank} must be in [0, {name('world_size')}={self.world_size})"
            )
        if self.local_world_size < 1 or self.local_world_size > max(self.world_size, 1):
            problems.append(
                f"{name('local_world_size')}={self.local_world_size} must be in "
                f"[1, {name('world_size')}={self.world_size}]"
            )
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            problems.append(
                f"{name('local_rank')}={self.local_rank} must be in "
                f"[0, {name('local_world_size')}={self.local_world_size})"
            )
        if self.world_size > 1 and not self.master_addr:
            problems.append(
                f"{name('world_size')}={self.world_size} needs a master address: "
                f"set {name('master_addr')}"
            )
        if self.world_size > 1 and self.master_port is None:
            problems.append(
                f"{name('world_size')}={self.world_size} needs a master port: "
                f"set {name('master_port')}"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            problems.append(f"{name('master_port')}={self.master_port} is not a TCP port")
        if problems:
            raise ClusterEnvironmentError(
                f"inconsistent {self.source} environment: "
                + "; ".join(problems)
                + ". Fix the launcher's variables or pass a ClusterEnvironment explicitly."
            )


_FIELD_NAMES: dict[str, dict[str, str]] = {
    "torchelastic": {
        "rank": "RANK",
        "world_size": "WORLD_SIZE",
        "local_rank": "LOCAL_RANK",
        "local_world_size": "LOCAL_WORLD_SIZE",
        "master_addr": "MASTER_ADDR",
        "master_port": "MASTER_PORT",
    },
    "slurm": {
        "rank": "SLURM_PROCID",
        "world_size": "SLURM_NTASKS",
        "local_rank": "SLURM_LOCALID",
        "local_world_size": "SLURM_NTASKS_PER_NODE",
        "master_addr": "SLURM_NODELIST/MASTER_ADDR",
        "master_port": "MASTER_PORT",
    },
    "openmpi": {
        "rank": "OMPI_COMM_WORLD_RANK",
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
        "master_addr": "MASTER_ADDR",
        "master_port": "MASTER_PORT",
    },
}


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ClusterEnvironmentError(f"environment variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ClusterEnvironmentError(
            f"environment variable {key}={raw!r} is not an integer"
        ) from None


def _port(env: Mapping[str, str]) -> int | None:
    return _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None


def from_torchelastic(env: Mapping[str, str]) -> ClusterEnvironment:
    """torchrun / torchelastic / torchx: RANK, WORLD_SIZE, LOCAL_RANK, ... set per worker."""
    world = _int(env, "WORLD_SIZE")
    return ClusterEnvironment(
        rank=_int(env, "RANK"),
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", 0),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
        node_rank=_int(env, "GROUP_RANK", 0),
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=_port(env),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        source="torchelastic",
        uses_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,9]-ib,cpu1' -> 'gpu003-ib'.

    Every bracketed range of the first entry contributes its first value; commas inside
    brackets do not end the entry.
    """
    host, depth = "", 0
    for char in nodelist.strip():
        if char == "," and depth == 0:
            break
        depth += {"[": 1, "]": -1}.get(char, 0)
        host += char
    expanded = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], host)
    if not host or host.startswith("[") or depth != 0 or not expanded:
        raise ClusterEnvironmentError(f"cannot read a host from SLURM_NODELIST={nodelist!r}")
    return expanded


def from_slurm(env: Mapping[str, str]) -> ClusterEnvironment:
    """srun-launched tasks: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODELIST."""
    world = _int(env, "SLURM_NTASKS")
    nodes = _int(env, "SLURM_NNODES", 1)
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    local_world = int(per_node) if per_node.isdigit() else max(world // max(nodes, 1), 1)
    master = env.get("MASTER_ADDR") or (
        first_slurm_host(env["SLURM_NODELIST"]) if env.get("SLURM_NODELIST") else None
    )
    port = _port(env)
    if port is None and env.get("SLURM_JOB_ID", "").isdigit():
        # Every task of the job derives the same port from the job id, without communicating.
        port = 15000 + int(env["SLURM_JOB_ID"]) % 20000
    return ClusterEnvironment(
        rank=_int(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=_int(env, "SLURM_LOCALID", 0),
        local_world_size=local_world,
        node_rank=_int(env, "SLURM_NODEID", 0),
        master_addr=master,
        master_port=port,
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        source="slurm",
    )


def from_mpi(env: Mapping[str, str]) -> ClusterEnvironment:
    """OpenMPI's mpirun: OMPI_COMM_WORLD_*; MASTER_ADDR/MASTER_PORT must be exported.

    The node index is rank // local size: OMPI_COMM_WORLD_NODE_RANK is a process's index on its
    node (across jobs), not the node's index.
    """
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    return ClusterEnvironment(
        rank=rank,
        world_size=world,
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_world_size=local_world,
        node_rank=rank // max(local_world, 1),
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=_port(env),
        source="openmpi",
    )


def single_process(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """No launcher: one process, rank 0 of 1."""
    return ClusterEnvironment(source="single")


def _is_torchelastic(env: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE"))


def _is_slurm(env: Mapping[str, str]) -> bool:
    # An interactive `salloc` shell has SLURM_NTASKS but no SLURM_PROCID for a task of its own.
    return (
        "SLURM_NTASKS" in env
        and "SLURM_PROCID" in env
        and env.get("SLURM_JOB_NAME") not in {"bash", "interactive"}
    )


def _is_mpi(env: Mapping[str, str]) -> bool:
    return "OMPI_COMM_WORLD_SIZE" in env


DETECTORS: tuple[tuple[str, Callable[[Mapping[str, str]], bool], Callable], ...] = (
    ("torchelastic", _is_torchelastic, from_torchelastic),
    ("slurm", _is_slurm, from_slurm),
    ("openmpi", _is_mpi, from_mpi),
)


def detect_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """Pick the first launcher whose variables are present; single process if none.

    torchrun's variables win over SLURM's so that `srun torchrun ...` uses the per-worker ranks.
    """
    env = os.environ if env is None else env
    for _, present, build in DETECTORS:
        if present(env):
            return build(env)
    return single_process(env)
