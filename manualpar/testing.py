"""Run a function on N real processes (gloo, CPU) for tests: short timeouts, tracebacks surfaced.

    def check(offset):
        strategy = ManualParallelStrategy()
        return strategy.all_reduce(torch.tensor(strategy.rank + offset), op="sum").item()

    assert run_distributed(check, world_size=2, args=(1,)) == [3, 3]

The function must be importable (defined at module level). Each child gets the torchrun-style
variables (RANK, WORLD_SIZE, ...), a collective timeout of a few seconds, one CPU thread and no
visible GPU (pass env={"CUDA_VISIBLE_DEVICES": ...} to change that).
A child's exception and traceback appear in the raised DistributedTestError; a job that runs past
its deadline has every live child's Python stack dumped, then is killed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from manualpar.errors import ConfigError
from manualpar.strategy.timeouts import TIMEOUT_ENV_VAR

__all__ = ["DistributedTestError", "RankOutcome", "free_port", "run_distributed"]

_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "GROUP_RANK", "ROLE_")


@dataclass
class RankOutcome:
    """What one rank did: returned `value`, or raised (`error_type`, `error`), or died."""

    rank: int
    ok: bool
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok"
        if self.error_type is None:
            return f"rank {self.rank}: died with exit code {self.exitcode}"
        return f"rank {self.rank}: {self.error_type}: {self.error}\n{self.traceback or ''}"


class DistributedTestError(AssertionError):
    """At least one rank failed; the message holds every failing rank's traceback."""

    def __init__(self, outcomes: Sequence[RankOutcome]) -> None:
        self.outcomes = list(outcomes)
        failed = [o.describe() for o in outcomes if not o.ok]
        super().__init__("distributed run failed:\n" + "\n".join(failed))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(
    fn_bytes: bytes,
    rank: int,
    env: Mapping[str, str],
    results: Any,
    start: Any,
    args: tuple,
    kwargs: dict,
) -> None:
    for key in list(os.environ):
        if key.startswith(_LAUNCHER_PREFIXES):
            del os.environ[key]
    os.environ.update(env)
    per_node = int(env["LOCAL_WORLD_SIZE"])  # ranks numbered node by node, as torchrun does
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["GROUP_RANK"] = str(rank // per_node)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch

    torch.set_num_threads(1)
    try:
        # Unpickled only now, so the test module is imported with this rank's environment
        # (e.g. GPUs already hidden when it asks torch.cuda at import time).
        fn = pickle.loads(fn_bytes)
    except BaseException as error:
        fn, outcome = None, _failed(rank, error)
    # The ranks start `fn` together: forked one after the other and each importing the test
    # module, they would otherwise start seconds apart on a loaded machine, and a test with a
    # collective timeout of a few seconds would time out joining the group.
    with contextlib.suppress(threading.BrokenBarrierError):  # a peer died before it
        start.wait()
    if fn is not None:
        try:
            outcome = RankOutcome(rank, ok=True, value=fn(*args, **kwargs))
        except BaseException as error:  # report everything, including SystemExit
            outcome = _failed(rank, error)
    # Plain pickle copies tensors by value; the queue's own pickler would pass shared-memory
    # handles that die with this process.
    results.put(pickle.dumps(outcome))
    sys.stdout.flush()
    sys.stderr.flush()


def _failed(rank: int, error: BaseException) -> RankOutcome:
    return RankOutcome(
        rank,
        ok=False,
        error_type=type(error).__name__,
        error=str(error),
        traceback=traceback.format_exc(),
    )


# Loaded once in the fork server, so every rank starts with them. `import manualpar` leaves the
# heavy parts of torch unloaded (docs/benchmarks.md, "Import time"); the ranks of most tests use
# them (FSDP, DTensor, the distributed checkpoint; torch._dynamo through any torch Optimizer),
# and importing them took each rank about 1 s of CPU, most of what a short test's ranks spend.
_PRELOAD = [
    "torch",
    "manualpar",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
]


def _context() -> Any:
    method = os.environ.get("MANUALPAR_TEST_START_METHOD", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout: float = 90.0,
    collective_timeout: float = 30.0,
    env: Mapping[str, str] | None = None,
    allow_failure: bool = False,
    local_world_size: int | None = None,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` processes; return each rank's value in order.

    `local_world_size` simulates nodes: ranks are numbered node by node, each rank seeing its
    LOCAL_RANK and node (GROUP_RANK) as under `torchrun --nnodes world/local`; default one node.

    With allow_failure=True, return a RankOutcome per rank instead of raising, so a test can
    assert how a failure surfaced on the surviving ranks.

    `collective_timeout` (default 30 s, as for jobs the tests launch): long enough that a rank
    slowed by a loaded machine (one started seconds after its peer, at load 8 on 2 cores) is
    not taken for a hung one; a test of the timeout itself passes its own, shorter one.
    """
    if local_world_size is not None and (local_world_size < 1 or world_size % local_world_size):
        raise ConfigError(
            f"run_distributed: local_world_size={local_world_size} must divide "
            f"world_size={world_size} (nodes of equal size)"
        )
    ctx = _context()
    fn_bytes = pickle.dumps(fn)
    for attempt in range(_PORT_ATTEMPTS):
        port = str(free_port())
        base_env = {
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size or world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            TIMEOUT_ENV_VAR: str(collective_timeout),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",  # the CPU/gloo path, also on a GPU machine
            **(env or {}),
        }
        # The port was free when free_port() let it go, not necessarily when rank 0 binds it:
        # another process may have taken it meanwhile. Then the job never started: run it again
        # on another port (unless the test chose the port).
        retry = attempt + 1 < _PORT_ATTEMPTS and base_env["MASTER_PORT"] == port
        name = getattr(fn, "__name__", fn)
        ordered = _run_job(ctx, name, fn_bytes, base_env, args, kwargs or {}, timeout, retry)
        if ordered is not None:
            break
    assert ordered is not None  # the last attempt never gives up on a taken port
    if allow_failure:
        return ordered
    if not all(o.ok for o in ordered):
        raise DistributedTestError(ordered)
    return [o.value for o in ordered]


_PORT_ATTEMPTS = 3


def _lost_the_port(outcome: RankOutcome, env: Mapping[str, str]) -> bool:
    """Whether `outcome` is a rank that found its job's port taken by another process (rank 0
    could not listen on it, or another job's ranks were met there)."""
    address = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    error = outcome.error or ""
    return address in error and (
        "already listens on" in error or "another process already joined the job at" in error
    )


def _run_job(
    ctx: Any,
    name: object,
    fn_bytes: bytes,
    env: Mapping[str, str],
    args: tuple,
    kwargs: dict,
    timeout: float,
    retry_on_taken_port: bool,
) -> list[RankOutcome] | None:
    """One run of the job: each rank's outcome in order, or None if `retry_on_taken_port` and a
    rank found the port taken (every rank is then killed)."""
    world_size = int(env["WORLD_SIZE"])
    results = ctx.Queue()
    start = ctx.Barrier(world_size, timeout=timeout)
    procs = [
        ctx.Process(
            target=_child, args=(fn_bytes, rank, env, results, start, args, kwargs), daemon=True
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                outcome = pickle.loads(results.get(timeout=0.05))
                outcomes[outcome.rank] = outcome
                if retry_on_taken_port and _lost_the_port(outcome, env):
                    for proc in procs:
                        proc.kill()
                    return None
                continue
            except queue.Empty:
                pass
            for rank, proc in enumerate(procs):
                if rank not in outcomes and proc.exitcode is not None:
                    start.abort()  # the others must not wait for it to start
                    # It may have queued its result just before exiting: drain once more.
                    time.sleep(0.2)
                    while not results.empty():
                        late = pickle.loads(results.get())
                        outcomes[late.rank] = late
                    if rank not in outcomes:
                        outcomes[rank] = RankOutcome(rank, ok=False, exitcode=proc.exitcode)
            if time.monotonic() > deadline:
                _dump_and_kill(procs, outcomes)
                live = sorted(set(range(world_size)) - set(outcomes))
                raise TimeoutError(
                    f"distributed run of {name} did not finish in {timeout:g}s; ranks {live} "
                    "were still running (their stacks are in the captured stderr)"
                )
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    ordered = [outcomes[rank] for rank in range(world_size)]
    for outcome in ordered:
        outcome.exitcode = procs[outcome.rank].exitcode
    return ordered


def _dump_and_kill(procs: Sequence[Any], outcomes: Mapping[int, RankOutcome]) -> None:
    live = [p for rank, p in enumerate(procs) if rank not in outcomes and p.is_alive()]
    for proc in live:
        os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)
    for proc in live:
        proc.kill()
