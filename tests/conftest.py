"""Shared by the three kinds of tests, each in its folder:

- unit/: one process, in-process only (no subprocess, no run_distributed); runs alone quickly.
- dist/: real gloo ranks through manualpar.testing.run_distributed, compared with a
  single-process reference computed in the test.
- e2e/:  torchrun and torchx subprocesses, the examples, benchmark smoke runs, injected faults
  (ranks that die, stall or are killed).

Helpers shared by several test files live in support/ (put on sys.path here, so tests and the
child processes of run_distributed import them by plain name); scripts launched by the e2e tests
live in scripts/.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

from heavy_first import make_scheduler  # noqa: E402  (needs SUPPORT on sys.path)
from launch import clean_env, is_launcher_variable  # noqa: E402
from warm import python_through_server  # noqa: E402

# One intra-op thread in the test process, as every rank and launched job has: torch's default
# (one per core) makes its threads spin-wait for each other, and with the other pytest worker
# and the ranks on 2 loaded cores a small op then waits milliseconds for a descheduled thread
# (an in-process test of 2,000 small ops took 48 s of wall and 10 s of CPU at load 13 on 2
# threads, 0.7 s and 0.24 s on one).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _single_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests run as a single process, whatever launcher started pytest."""
    for key in list(os.environ):
        if is_launcher_variable(key):
            monkeypatch.delenv(key, raising=False)


@pytest.fixture
def warm_launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For a launcher that a test runs in its own process (torchx's Runner): the `python`
    processes it starts get the launched jobs' settings (launch.clean_env: one thread, no GPU)
    and start as forks of the warm server, as run_python's and run_torchrun's jobs do
    (warm.py): each saves the seconds of CPU of a fresh interpreter's imports."""
    for key, value in clean_env().items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)
    with python_through_server():
        yield


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the C++ embedding kernels once, before any test starts ranks: a first build takes
    tens of seconds, longer than the tests' collective timeouts. Here rather than in a test's
    setup, so that a build does not count against that test's timeout; under pytest-xdist the
    workers do it (the first builds, the other waits for its lock), not the controller, which
    would have to import manualpar before starting them."""
    if session.config.pluginmanager.has_plugin("dsession"):  # xdist's controller
        return
    from manualpar.embeddings.kernels.native import native_kernels

    native_kernels()


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """--dist loadscope starts the files of launched jobs first (heavy_first.py)."""
    return make_scheduler(config, log) if config.getvalue("dist") == "loadscope" else None
