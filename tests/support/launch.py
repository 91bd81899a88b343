"""Start a script the way a user does, from a test: under torchrun, or as one plain process.

    result = run_torchrun(SCRIPT, "--out", str(tmp_path), nproc=2, check=True)
    node0, node1 = run_nodes(SCRIPT, "--out", str(tmp_path), nnodes=2, nproc=2, check=True)

`run_nodes` (and `start_nodes`, for a test that acts on a running job, e.g. kills a node) start
one torchrun agent per node on this machine, meeting through a c10d rendezvous on 127.0.0.1, as
the agents of a real multi-node job do.

The child gets `clean_env()`: the caller's environment without any launcher's variables (so a
pytest started by torchrun, srun or mpirun does not leak its ranks into the job), a collective
timeout short enough for a test, one CPU thread per process and no visible GPU (the CPU/gloo
path everywhere). A job that outlives `timeout` is stopped, its launcher first (which stops its
workers), and the test fails with the output so far.

`run_python` and `run_torchrun` start their interpreters (and torchrun its workers) as forks of a
warm server that has torch and manualpar imported (warm.py): 2.5-3.5 s of CPU less a process.
A job whose start-up settings differ, and `start_nodes` (whose tests kill a node's process
tree), get fresh interpreters; MANUALPAR_TEST_WARM=0 gives every job one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import warm
from procfs import descendants, listeners, process_group, sockets

from manualpar.testing import _PORT_ATTEMPTS, free_port

__all__ = [
    "TIMEOUT_S",
    "NodeJob",
    "c10d_command",
    "clean_env",
    "is_launcher_variable",
    "output_tail",
    "run_nodes",
    "run_python",
    "run_torchrun",
    "start_nodes",
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
    result = _run_warm(command, env, timeout)
    if result is None:
        result = _run_fresh(command, env, timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"failed\n{output_tail(result)}")
    return result


def _run_warm(
    command: Sequence[str], env: Mapping[str, str | None] | None, timeout: float
) -> subprocess.CompletedProcess[str] | None:
    """The job as a fork of the warm server (see warm.py), which saves each process the imports
    of a fresh interpreter; None where it must be a fresh interpreter."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = warm.start(command, clean_env(env), stdout=out, stderr=err)
        if process is None:
            return None
        stopped = False
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            stopped = True
            process.terminate()  # as _stop: the launcher first, which stops its workers
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        texts = []
        for file in (out, err):
            file.seek(0)
            texts.append(file.read())
    code = process.wait()  # known by now: it exited or was stopped
    result = subprocess.CompletedProcess(list(command), code, *texts)
    if stopped:
        raise AssertionError(
            f"did not finish in {timeout:g}s and was stopped\n{output_tail(result)}"
        )
    return result


def _run_fresh(
    command: Sequence[str],
    env: Mapping[str, str | None] | None,
    timeout: float,
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
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


def _stop(process: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM first, so torchrun stops its workers (each in its own session); then SIGKILL
    whatever is left of the launcher's process group."""
    process.terminate()
    try:
        return process.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()


# ---- several nodes on one machine ---------------------------------------------------------------


def c10d_command(
    script: str | os.PathLike,
    *args: str,
    nnodes: int,
    nproc: int,
    node: int,
    port: int,
    run_id: str,
    max_restarts: int = 0,
) -> list[str]:
    """Node `node`'s torchrun command in a c10d rendezvous at 127.0.0.1:port.

    c10d ignores --node-rank (static rendezvous only) and numbers the nodes by their sorted
    (address, pid), the address as a string. Each node gets its own loopback address
    127.0.0.<100 + node> (--local-addr; same length, so string order is node order), so the
    agent started as node k is GROUP_RANK k, and node 0 hosts both stores: the rendezvous store
    (is_host) and the workers' store (the rank-0 agent's)."""
    if not 0 <= node < nnodes <= 100:
        raise ValueError(f"node {node} of {nnodes}: at most 100 nodes on one machine")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        f"is_host={str(node == 0).lower()},join_timeout=120",
        "--local-addr",
        f"127.0.0.{100 + node}",
        "--max-restarts",
        str(max_restarts),
        str(script),
        *args,
    ]


class PortTaken(AssertionError):
    """Node 0 could not host the rendezvous store: another process took its port after
    free_port() let it go (start_nodes then starts the job again on another port)."""


class NodeJob:
    """A job of `nnodes` torchrun agents on this machine, one per node, each in its own process
    group; their output goes to files so it can be read while they run. Use as a context
    manager: leaving it stops whatever still runs. PortTaken if node 0 could not listen on
    `port` (every agent is stopped then)."""

    def __init__(self, commands: Sequence[Sequence[str]], env: dict[str, str], port: int) -> None:
        self.commands = [list(c) for c in commands]
        self.processes: list[subprocess.Popen[str]] = []
        self._files = [  # closed by __exit__
            (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))  # noqa: SIM115
            for _ in commands
        ]
        for node, command in enumerate(self.commands):
            out, err = self._files[node]
            self.processes.append(
                subprocess.Popen(
                    command, stdout=out, stderr=err, text=True, env=env, start_new_session=True
                )
            )
            if node == 0:  # the store's host listens before anyone connects to it
                try:
                    self._wait_for_store(port)
                except AssertionError:
                    self.__exit__()
                    raise

    def __enter__(self) -> NodeJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for out, err in self._files:
            out.close()
            err.close()

    def _wait_for_store(self, port: int) -> None:
        """Until node 0's agent listens on `port`; PortTaken if another process listens there
        or the agent could not (EADDRINUSE), failing the test if 60 s pass first."""
        agent = self.processes[0]

        def listening() -> bool:
            listening_now = listeners(port)
            if listening_now & sockets([agent.pid, *descendants(agent.pid)]):
                return True
            exited = agent.poll() is not None
            if listening_now or (exited and "EADDRINUSE" in self.result(0).stderr):
                self.stop()
                raise PortTaken(f"port {port} was taken by another process\n{self.outputs()}")
            return False

        self.wait_for(listening, 60, f"node 0 to host the rendezvous store on port {port}")

    def result(self, node: int) -> subprocess.CompletedProcess[str]:
        """Node `node`'s command, exit code (None while it runs) and output so far."""
        out, err = self._files[node]
        texts = []
        for file in (out, err):
            file.flush()
            file.seek(0)
            texts.append(file.read())
        code = self.processes[node].poll()
        return subprocess.CompletedProcess(self.commands[node], code, *texts)  # type: ignore[arg-type]

    def outputs(self) -> str:
        """Every node's output, for a failure message."""
        return "\n".join(
            f"===== node {n} =====\n{output_tail(self.result(n))}"
            for n in range(len(self.processes))
        )

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `condition` until it holds; fail with every node's output if `timeout` passes
        first or a node exits meanwhile."""
        deadline = time.monotonic() + timeout
        while not condition():
            exited = [n for n, p in enumerate(self.processes) if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                reason = f"node(s) {exited} exited" if exited else f"{timeout:g}s passed"
                self.stop()
                raise AssertionError(f"waiting for {what}: {reason}\n{self.outputs()}")
            time.sleep(0.1)

    def wait(
        self, timeout: float, *, nodes: Sequence[int] | None = None, check: bool = False
    ) -> list[subprocess.CompletedProcess[str]]:
        """Wait for `nodes` (default: all) to exit, all within `timeout` seconds; past it every
        node is stopped and the test fails with their output. check=True: so does any non-zero
        exit."""
        nodes = list(range(len(self.processes))) if nodes is None else list(nodes)
        deadline = time.monotonic() + timeout
        for node in nodes:
            try:
                self.processes[node].wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                self.stop()
                raise AssertionError(
                    f"node {node} did not finish in {timeout:g}s; every node was stopped\n"
                    f"{self.outputs()}"
                ) from None
        results = [self.result(n) for n in nodes]
        if check and any(r.returncode != 0 for r in results):
            raise AssertionError(f"a node failed\n{self.outputs()}")
        return results

    def kill_node(self, node: int) -> None:
        """Lose node `node` at once, as a machine that dies: SIGKILL to its agent's process
        group and to every worker's (torchrun starts each worker in a session of its own)."""
        root = self.processes[node].pid
        groups = {root} | {process_group(pid) for pid in descendants(root)}
        # Freeze the whole node first, then kill it: killed one group at a time, a worker still
        # running while its peer's death is seen elsewhere could answer the survivors' roll
        # call (seen once under heavy load); a stopped one cannot, and dies on SIGKILL.
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for group in groups - {None}:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, sig)  # type: ignore[arg-type]
        self.processes[node].wait()

    def stop(self) -> None:
        """SIGTERM every running agent (it stops its workers), then SIGKILL what is left."""
        running = [p for p in self.processes if p.poll() is None]
        trees = {p.pid: descendants(p.pid) for p in running}
        for process in running:
            process.terminate()
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=15)
        for root, children in trees.items():
            for pid in (root, *children):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        for process in running:
            process.wait()


def start_nodes(
    script: str | os.PathLike,
    *args: str,
    nnodes: int = 2,
    nproc: int = 2,
    max_restarts: int = 0,
    env: Mapping[str, str | None] | None = None,
) -> NodeJob:
    """Start `script *args` as a job of `nnodes` nodes x `nproc` processes: one torchrun agent
    per node, node 0 first (it hosts the stores), then the others once it listens. As
    run_distributed, on another port if the one free_port() gave was taken before node 0 bound
    it (at most _PORT_ATTEMPTS ports)."""
    for attempt in range(_PORT_ATTEMPTS):
        port = free_port()
        commands = [
            c10d_command(
                script,
                *args,
                nnodes=nnodes,
                nproc=nproc,
                node=node,
                port=port,
                run_id=f"test-{port}",
                max_restarts=max_restarts,
            )
            for node in range(nnodes)
        ]
        try:
            return NodeJob(commands, clean_env(env), port)
        except PortTaken:
            if attempt + 1 == _PORT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def run_nodes(
    script: str | os.PathLike,
    *args: str,
    nnodes: int = 2,
    nproc: int = 2,
    max_restarts: int = 0,
    env: Mapping[str, str | None] | None = None,
    timeout: float = 180,
    check: bool = False,
) -> list[subprocess.CompletedProcess[str]]:
    """Run `script *args` on `nnodes` nodes x `nproc` processes and wait for every node; one
    result per node. Past `timeout` every agent is stopped and the test fails with all outputs."""
    with start_nodes(
        script, *args, nnodes=nnodes, nproc=nproc, max_restarts=max_restarts, env=env
    ) as job:
        return job.wait(timeout, check=check)
