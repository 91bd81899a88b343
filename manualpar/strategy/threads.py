"""CPU threads per process: one clear rule, said in one log line.

torch gives every process one intra-op thread per physical core. torchrun sets OMP_NUM_THREADS=1
for each of several workers, but a plain `python train.py`, or several processes started by
SLURM or MPI, keep that default: N processes on one machine then run N times as many threads as
it has cores. On a shared 2-core machine one process with torch's 2 threads swung from 33 ms to
578 ms a step while other work ran; with 1 thread it never did (docs/launch.md, "Threads").

The rule: an explicit `num_threads` wins, then OMP_NUM_THREADS (which torch already applied),
else torch's default divided among the processes of this node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from manualpar.errors import ClusterEnvironmentError

__all__ = ["ThreadChoice", "apply_threads", "choose_threads"]

THREADS_ENV_VAR = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    """How many intra-op threads this process runs, and why (for the log line)."""

    count: int
    reason: str

    def describe(self, local_processes: int) -> str:
        return (
            f"CPU threads: {self.count} per process, {local_processes} process(es) on this "
            f"node ({self.reason}); change with ManualParallelStrategy(num_threads=...) or "
            f"{THREADS_ENV_VAR}"
        )


def choose_threads(
    num_threads: int | None,
    local_world_size: int,
    environ: Mapping[str, str],
    torch_default: int,
) -> ThreadChoice:
    """The thread count by the rule in the module docstring."""
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ClusterEnvironmentError(
                f"ManualParallelStrategy(num_threads={num_threads!r}): pass a whole number >= 1, "
                "or None for the default (torch's threads divided among this node's processes)"
            )
        return ThreadChoice(num_threads, "num_threads")
    raw = environ.get(THREADS_ENV_VAR)
    if raw is not None:
        try:
            count = int(raw)
        except ValueError:
            count = 0
        if count < 1:
            raise ClusterEnvironmentError(
                f"{THREADS_ENV_VAR}={raw!r} is not a thread count; set a whole number >= 1 or "
                "unset it"
            )
        return ThreadChoice(count, THREADS_ENV_VAR)
    processes = max(local_world_size, 1)
    count = max(torch_default // processes, 1)
    if processes == 1:
        return ThreadChoice(
            count, "torch's default, one per core; on a shared machine 1 is steadier"
        )
    return ThreadChoice(count, f"torch's {torch_default} divided among {processes} processes")


def apply_threads(choice: ThreadChoice) -> None:
    """Set torch's intra-op threads (a no-op where it already runs that many)."""
    if torch.get_num_threads() != choice.count:
        torch.set_num_threads(choice.count)
