"""`python train.py` that starts its own local workers: the script re-run under torchrun.

`ManualParallelStrategy(num_processes=N)` in a process that no launcher started replaces that
process with `python -m torch.distributed.run --standalone --nproc-per-node N <the same
command line>`: each worker then runs the script from the top, as under torchrun (the same
variables, OMP_NUM_THREADS=1, restarts with `max_restarts`), and torchrun's exit code and signal
handling are the job's. Under a launcher the strategy checks N against it instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from manualpar.errors import ClusterEnvironmentError

__all__ = ["check_num_processes", "launch_command", "launched", "relaunch_under_torchrun"]

# Set by every launcher manualpar reads (torchrun, SLURM, MPI): a process without them is a
# plain `python train.py`.
_LAUNCHER_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def launched(environ: Mapping[str, str]) -> bool:
    return any(name in environ for name in _LAUNCHER_VARS)


def launch_command(
    num_processes: int, max_restarts: int, argv: Sequence[str], main_module: str | None
) -> list[str]:
    """torchrun's command line for this script: `-m module` where it was run as a module."""
    if main_module is not None:
        target = ["-m", main_module]
    elif argv and argv[0] not in ("", "-c"):
        target = [argv[0]]
    else:
        raise ClusterEnvironmentError(
            "ManualParallelStrategy(num_processes=...) re-runs the script under torchrun, but "
            "this process runs no script file (an interactive session or python -c); save the "
            "code to a file and run it, or launch with torchrun"
        )
    # "--" ends torchrun's own options: without it, a script flag that abbreviates one of them
    # (--nproc) made torchrun exit ("ambiguous option"); torchrun drops this "--" itself.
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(num_processes), "--max-restarts", str(max_restarts),
        *target, "--", *argv[1:],
    ]  # fmt: skip


def check_num_processes(num_processes: int, max_restarts: int) -> None:
    for name, value, least in (
        ("num_processes", num_processes, 1),
        ("max_restarts", max_restarts, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ClusterEnvironmentError(
                f"ManualParallelStrategy({name}={value!r}): pass a whole number >= {least}"
            )


def relaunch_under_torchrun(num_processes: int, max_restarts: int) -> None:
    """Replace this process with torchrun over `num_processes` local workers (never returns)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    command = launch_command(num_processes, max_restarts, sys.argv, getattr(spec, "name", None))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)
