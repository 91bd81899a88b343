"""A warm fork server for the processes the e2e tests launch: a fresh interpreter spends 2.5-3.5 s
of CPU importing torch, manualpar, DTensor, FSDP and torch._dynamo before its own work, and the
e2e tests start about a hundred of them (scripts, torchrun agents and their workers).

    process = start([sys.executable, script, *args], env, stdout=out, stderr=err)
    if process is None:  # not one the server runs as an interpreter would: start it plainly
        ...
    process.wait(timeout)

The server is a fresh interpreter (started once per test process, before any thread) that
imports those modules and then only forks: a job is a fork of it that becomes
`python script.py`, `python -m module` or `python -c code` with the request's argv, environment,
working directory and standard streams, in a session of its own (as `start_new_session=True`).
Each job's own monitor (another fork) reports its pid and exit code; `WarmProcess` is the
Popen-like handle on it. Inside a job, torchrun's worker processes come from the same server,
and so does any `python ...` the job starts with subprocess (through SHIM, a few-ms interpreter
that stands in for it): a launched job's ranks, and the torchrun jobs a benchmark launches
itself, start warm too.

What a job cannot change is what an interpreter reads once at start-up: a request that sets
PYTHON*, OMP_*, MKL_*, LD_*, the compiler's or the GPU settings, or interpreter options
other than -u differently from the server is answered "fallback" and started plainly (a
PYTHONPATH is accepted where all its entries are on the server's sys.path already). Jobs share
the server's string-hash seed, as the ranks of run_distributed share their fork server's.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import io
import json
import os
import random
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["WarmProcess", "python_through_server", "start"]

DISABLE_VAR = "MANUALPAR_TEST_WARM"  # "0": every launch is a fresh interpreter
PRELOAD = [
    "torch",
    "manualpar",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    # what torchrun's agent imports (not torch.distributed.run itself: runpy would warn that it
    # runs a module already imported)
    "torch.distributed.launcher.api",
    "torch.distributed.elastic.multiprocessing",
    "numpy",
]
# Read once at interpreter start (or at the import of a preloaded module): a job cannot change
# them, so a request that sets them differently from the server is started plainly.
STARTUP_PREFIXES = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "KMP_",
    "LD_",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "TORCH_LOGS",
    "TORCH_COMPILE",
    "CUDA_VISIBLE_DEVICES",
    "MANUALPAR_NO_OPTIMIZER_CHECK",
    DISABLE_VAR,
)
# Start-up settings a job applies itself (PYTHONPATH: where it does not hide a loaded module).
EMULATED = frozenset(
    {"PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED"}
)
_HEADER = struct.Struct("!Q")


# ---- client -------------------------------------------------------------------------------------


class WarmProcess:
    """A job of the warm server, used as a subprocess.Popen: pid, returncode, poll, wait,
    send_signal, terminate, kill. Its pid leads its own session (so killpg(pid) reaches it)."""

    def __init__(self, command: Sequence[str], conn: socket.socket, pid: int) -> None:
        self.args = list(command)
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._pending = b""

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> None:
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return
        chunk = self._conn.recv(4096)
        self._pending += chunk
        if b"\n" in self._pending:
            self.returncode = int(self._pending.split(b"\n", 1)[0].split()[1])
            self._conn.close()
        elif not chunk:  # the monitor died without a word: report it as a crash
            self.returncode = -int(signal.SIGKILL)
            self._conn.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()


def start(
    command: Sequence[str],
    env: Mapping[str, str],
    *,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    cwd: str | None = None,
) -> WarmProcess | None:
    """Start `command` as a job of the warm server; None if it must be a fresh interpreter."""
    if os.environ.get(DISABLE_VAR) == "0" or env.get(DISABLE_VAR) == "0":
        return None
    path = _SERVER_PATH or _ensure_server()
    fds = [0, _fileno(stdout, 1), _fileno(stderr, 2)]
    request = {"argv": list(map(str, command)), "env": dict(env), "cwd": cwd or os.getcwd()}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        payload = json.dumps(request).encode()
        socket.send_fds(conn, [_HEADER.pack(len(payload)) + payload], fds)
        reply = _read_line(conn)
    except OSError:
        conn.close()
        raise
    if not reply.startswith(b"pid "):
        conn.close()
        return None
    return WarmProcess(command, conn, int(reply.split()[1]))


def _fileno(stream: IO[Any] | int | None, default: int) -> int:
    if stream is None:
        return default
    return stream if isinstance(stream, int) else stream.fileno()


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            break
        data += chunk
    return data


_SERVER_PATH: str | None = None  # set in the server and its forks; the client learns it below
_SERVER: subprocess.Popen[bytes] | None = None


def _ensure_server() -> str:
    """Start this test process's server (once) and wait until it listens."""
    global _SERVER, _SERVER_PATH
    from launch import clean_env  # the same environment the launched jobs get

    folder = tempfile.mkdtemp(prefix="warm-")
    path = os.path.join(folder, "server.sock")
    log = open(os.path.join(folder, "server.log"), "wb")  # noqa: SIM115 (the server's lifetime)
    _SERVER = subprocess.Popen(
        [sys.executable, __file__, path],
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    atexit.register(_stop_server, _SERVER, folder)
    deadline = time.monotonic() + 300  # the preload takes seconds, minutes on a loaded machine
    while not os.path.exists(path + ".ready"):
        if _SERVER.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the warm fork server did not start; see {folder}/server.log")
        time.sleep(0.05)
    _SERVER_PATH = path
    return path


def _stop_server(server: subprocess.Popen[bytes], folder: str) -> None:
    with contextlib.suppress(ProcessLookupError):
        server.kill()
    server.wait()
    shutil.rmtree(folder, ignore_errors=True)


# ---- server -------------------------------------------------------------------------------------


def _serve(path: str, startup: Mapping[str, str]) -> dict[str, Any]:
    """Accept requests until the test process goes; return only in a job (a fork). `startup`:
    the start-up settings the server was started with (a job's must be the same)."""
    global _SERVER_PATH
    _SERVER_PATH = path
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    listener.settimeout(1.0)
    Path(path + ".ready").touch()
    parent = os.getppid()
    while True:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        if os.getppid() != parent:  # the test process is gone
            os._exit(0)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        job = _job(request, startup)
        if job is None:
            with contextlib.suppress(OSError):
                conn.sendall(b"fallback\n")
        elif os.fork() == 0:
            listener.close()
            return _monitor(conn, job, fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    if len(data) < _HEADER.size:
        raise ValueError("short request")
    (size,) = _HEADER.unpack(data[: _HEADER.size])
    data = data[_HEADER.size :]
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("truncated request")
        data += chunk
    return json.loads(data), list(fds)


def _job(request: dict[str, Any], startup: Mapping[str, str]) -> dict[str, Any] | None:
    """What to run (script, module or code), or None where a job would not match a fresh
    interpreter: another interpreter, options other than -u, start-up settings that differ."""
    env = request["env"]
    asked = {
        k: v
        for k, v in env.items()
        if k.startswith(STARTUP_PREFIXES) and _SET_BY_PRELOAD.get(k) != v and k not in EMULATED
    }
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    shadowing = [p for p in path if _shadows_preloaded(p)]
    if shadowing:  # e.g. another source tree of manualpar
        print(f"fallback: PYTHONPATH entries {shadowing} hold modules already loaded", flush=True)
        return None
    if asked != {k: v for k, v in startup.items() if k not in EMULATED}:
        print(f"fallback: start-up settings {asked} differ from {dict(startup)}", flush=True)
        return None
    argv = list(request["argv"])
    if not argv or os.path.abspath(argv[0]) != os.path.abspath(sys.executable):
        return None
    rest = argv[1:]
    unbuffered = False
    while rest and rest[0] == "-u":
        unbuffered, rest = True, rest[1:]
    if not rest:
        return None
    if rest[0] in ("-m", "-c") and len(rest) > 1:
        kind, target, args = rest[0], rest[1], rest[2:]
    elif rest[0].startswith("-"):
        return None
    else:
        kind, target, args = "path", rest[0], rest[1:]
    return {
        **request,
        **{"kind": kind, "target": target, "args": args, "unbuffered": unbuffered, "path": path},
    }


def _shadows_preloaded(entry: str) -> bool:
    """Whether a module the server has loaded would come from `entry` in a fresh interpreter
    (PYTHONPATH precedes the installed packages): then the job cannot be a fork of the server."""
    if os.path.abspath(entry) in {os.path.abspath(p) for p in sys.path}:
        return False  # the server loaded its modules with this entry on its path already
    top = {name.partition(".")[0] for name in sys.modules}
    try:
        names = os.listdir(entry)
    except OSError:
        return False
    return any(
        n.partition(".")[0] in top for n in names if n.endswith((".py", ".so")) or "." not in n
    )


def _monitor(conn: socket.socket, job: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    """In a fork of the server: fork the job, report its pid and exit code; kill it if the
    client goes first. Returns only in the job."""
    pid = os.fork()
    if pid == 0:
        conn.close()
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return job
    for fd in fds:
        os.close(fd)
    code = None
    try:
        conn.sendall(f"pid {pid}\n".encode())
        exited = os.pidfd_open(pid)
        while code is None:
            ready, _, _ = select.select([conn.fileno(), exited], [], [])
            if exited in ready:
                code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            elif not conn.recv(1):
                break  # the client is gone: so goes its job
        if code is not None:
            conn.sendall(f"exit {code}\n".encode())
    except OSError:
        pass
    if code is None:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)
    os._exit(0)


def _run_job(job: dict[str, Any]) -> None:
    """Become the interpreter the request named: its argv, environment, directory, streams."""
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(_SET_BY_PRELOAD)  # as the imports would have set them (if not already)
    os.environ.update(job["env"])
    random.seed()  # a fresh interpreter seeds from the OS, not from its parent's state
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    _reopen_streams(job["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.path[1:1] = job["path"]  # where a fresh interpreter puts PYTHONPATH
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    subprocess.Popen._execute_child = _through_shim(subprocess.Popen._execute_child)  # type: ignore[attr-defined]
    kind, target = job["kind"], job["target"]
    if kind == "path":
        sys.argv = [target, *job["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    elif kind == "-m":
        sys.argv = [target, *job["args"]]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *job["args"]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec"), main.__dict__)


def _reopen_streams(unbuffered: bool) -> None:
    """sys.std* over the job's file descriptors, buffered as a fresh interpreter's would be."""
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        tty = raw.isatty()
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            errors="backslashreplace" if name == "stderr" else "strict",
            line_buffering=tty or name == "stderr",
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


# Run by `python -I -S -c SHIM socket argv...` in place of `python argv...` (a few ms, no site,
# no torch): it hands its streams, environment and directory to the server and lives as long as
# the job, passing on the signals it gets and exiting as the job did. If the server answers
# "fallback", it becomes the real interpreter (exec), same pid, same streams.
SHIM = r"""
import json, os, signal, socket, struct, sys
path, argv = sys.argv[1], sys.argv[2:]
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    conn.connect(path)
    payload = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(payload)) + payload], [0, 1, 2])
    reply = conn.makefile("rb").readline().split()
except OSError:
    reply = []
if not reply or reply[0] != b"pid":
    conn.close()
    os.execv(argv[0], argv)
pid = int(reply[1])
def forward(sig, frame):
    try:
        os.killpg(pid, sig)
    except OSError:
        pass
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, forward)
line = b""
while not line.endswith(b"\n"):
    chunk = conn.recv(64)
    if not chunk:
        os._exit(1)
    line += chunk
code = int(line.split()[1])
if code < 0:  # die of the same signal
    try:
        signal.signal(-code, signal.SIG_DFL)
    except (OSError, ValueError):  # SIGKILL's handler cannot be set, nor needs to
        pass
    os.kill(os.getpid(), -code)
os._exit(code & 0xFF)
"""


@contextlib.contextmanager
def python_through_server() -> Iterator[None]:
    """While it lasts, a `python ...` this (test) process starts with subprocess runs as a job of
    the warm server, as one a job starts does: for a launcher that a test runs in its own
    process (torchx's Runner, whose local scheduler starts torchrun). The job must be given the
    server's start-up settings (clean_env's), or it starts plainly."""
    if os.environ.get(DISABLE_VAR) == "0":
        yield
        return
    _SERVER_PATH or _ensure_server()
    plain = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    subprocess.Popen._execute_child = _through_shim(plain)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        subprocess.Popen._execute_child = plain  # type: ignore[attr-defined]


def _through_shim(execute_child: Any) -> Any:
    """Popen's process start in a job: `python ...` (this interpreter) runs as a warm job too,
    through SHIM, so a benchmark that launches its own torchrun jobs starts them warm."""

    def execute(self: Any, args: Any, executable: Any, *rest: Any, **kwargs: Any) -> Any:
        shell = rest[7] if len(rest) > 7 else kwargs.get("shell", False)
        if (
            not shell
            and executable is None
            and isinstance(args, list | tuple)
            and args
            and os.path.abspath(str(args[0])) == os.path.abspath(sys.executable)
        ):
            args = [sys.executable, "-I", "-S", "-c", SHIM, _SERVER_PATH, *map(str, args)]
        return execute_child(self, args, executable, *rest, **kwargs)

    return execute


def _warm_worker_popen(self: Any, args: tuple, env: dict[str, str]) -> Any:
    """torchrun's worker start (SubprocessHandler._popen), through the warm server."""
    process = start(args, env, stdout=self._stdout, stderr=self._stderr)
    if process is None:
        return _PLAIN_POPEN(self, args, env)
    return process


_PLAIN_POPEN: Any = None
_SET_BY_PRELOAD: dict[str, str] = {}  # e.g. TORCHINDUCTOR_CACHE_DIR, set by an import


def _preload() -> None:
    global _PLAIN_POPEN
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    _PLAIN_POPEN = subprocess_handler.SubprocessHandler._popen
    subprocess_handler.SubprocessHandler._popen = _warm_worker_popen  # type: ignore[method-assign]


def _main() -> None:
    environ = dict(os.environ)
    _preload()
    _SET_BY_PRELOAD.update({k: v for k, v in os.environ.items() if k not in environ})
    # The preloaded objects never change: out of the collector's sight, a job's collections
    # neither walk them (CPU) nor write their headers (which would copy the shared pages).
    gc.collect()
    gc.freeze()
    startup = {k: v for k, v in environ.items() if k.startswith(STARTUP_PREFIXES)}
    # A job leaves as an interpreter does (SystemExit, an uncaught exception's traceback, atexit,
    # the interpreter's teardown): tests of how a script exits see the real thing.
    _run_job(_serve(sys.argv[1], startup))


if __name__ == "__main__":
    _main()
