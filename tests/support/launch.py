"""Start a script the way a user does, from a test: under torchrun, or as one plain process.

    result = run_torchrun(SCRIPT, "--out", str(tmp_path), nproc=2, check=True)

The child gets `clean_env()`: the caller's environment without any launcher's variables (so a
pytest started by torchrun, srun or mpirun does not leak its ranks into the job), a collective
timeout short enough for a test, one CPU thread per process and no visible GPU (the CPU/gloo
path everywhere). A job that outlives `timeout` is stopped, its launcher first (which stops its
workers), and the test fails with the output so far.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = [
    "TIMEOUT_S",
    "clean_env",
    "is_launcher_variable",
    "output_tail",
    "run_python",
    "run_torchrun",
    "torchrun_command",
]

LAUNCHER_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
LAUNCHER_PREFIXES = ("ROLE_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_")
TIMEOUT_S = 30  # MANUALPAR_TIMEOUT_S of a launched job: a hung collective fails the test quickly


def is_launcher_variable(name: str) -> bool:
    """Whether torchrun, torchx, SLURM, Open MPI or a PMI launcher sets `name` for its ranks."""
    return name in LAUNCHER_VARIABLES or name.startswith(LAUNCHER_PREFIXES)


def clean_env(env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """os.environ without launcher variables, with test settings; `env` is applied last (a
    value of None removes the variable)."""
    clean = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    clean.update(
        MANUALPAR_TIMEOUT_S=str(TIMEOUT_S),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    for key, value in (env or {}).items():
        if value is None:
            clean.pop(key, None)
        else:
            clean[key] = value
    return clean


def torchrun_command(
    script: str | os.PathLike,
    *args: str,
    nproc: int = 2,
    nnodes: int = 1,
    node_rank: int | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line: standalone on one node; with nnodes > 1, one node's share of
    a static rendezvous at 127.0.0.1:master_port (start one command per node_rank)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if max_restarts:
        command += ["--max-restarts", str(max_restarts)]
    if nnodes == 1 and node_rank in (None, 0) and master_port is None:
        command.append("--standalone")
    else:
        if node_rank is None or master_port is None:
            raise ValueError("a job of several nodes needs node_rank and master_port")
        command += [
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node_rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(master_port),
        ]
    return [*command, str(script), *args]


def run_torchrun(
    script: str | os.PathLike,
    *args: str,
    nproc: int = 2,
    nnodes: int = 1,
    node_rank: int | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 180,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `script *args` under torchrun on `nproc` processes and wait for it.

    With check=True a non-zero exit fails the test with the job's output."""
    command = torchrun_command(
        script,
        *args,
        nproc=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        master_port=master_port,
        max_restarts=max_restarts,
    )
    return _run(command, env, timeout, check)


def run_python(
    script: str | os.PathLike,
    *args: str,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 180,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `script *args` as one plain process (no launcher), with the same environment."""
    return _run([sys.executable, str(script), *args], env, timeout, check)


def output_tail(result: subprocess.CompletedProcess[str], chars: int = 6000) -> str:
    """The end of what a job printed, for a failure message."""
    return (
        f"$ {' '.join(map(str, result.args))}\nexit code {result.returncode}\n"
        f"--- stdout ---\n{(result.stdout or '')[-chars:]}\n"
        f"--- stderr ---\n{(result.stderr or '')[-chars:]}"
    )


def _run(
    command: Sequence[str],
    env: Mapping[str, str | None] | None,
    timeout: float,
    check: bool,
) -> subprocess.CompletedProcess[str]:
    with subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(env),
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _stop(process)
            result = subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
            raise AssertionError(
                f"did not finish in {timeout:g}s and was stopped\n{output_tail(result)}"
            ) from None
    result = subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"failed\n{output_tail(result)}")
    return result


def _stop(process: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM first, so torchrun stops its workers (each in its own session); then SIGKILL
    whatever is left of the launcher's process group."""
    process.terminate()
    try:
        return process.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()
