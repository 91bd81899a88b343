"""PhaseTimes: wall-clock seconds per named phase of a step, recorded only while switched on.

Public as `mp.phase_times` (the phase names a benchmark or a reader of step times looks up), and
a core module because two layers share one recorder. A sharded collection's step times its own
phases through the recorder it holds (`emb.phase_times`): IDS_EXCHANGE (input dist: checks,
hashing, the size agreement and the ids' all_to_all, and the wait for them), LOOKUP,
POOLED_EXCHANGE (output dist: the wait for the pooled rows and
adding them in), GRAD_EXCHANGE (gradient dist and the waits for it) and UPDATE (the fused
rule). A caller that times a larger step hands every collection one recorder and times its own
phases with it too (the Trainer: loop/step_times.py), so a phase run inside another counts once:
its seconds are taken out of the enclosing phase's (exclusive times).

Off (the default), a phase costs one attribute test. On, each phase boundary synchronizes the
device first: CUDA kernels run asynchronously, so without it a phase would measure the time to
queue its kernels and their run would land in whichever later phase waits. Those
synchronizations are the cost of timing (they remove the overlap of compute across phases),
which is why a loop times chosen steps only.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from types import TracebackType
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch

__all__ = [
    "GRAD_EXCHANGE",
    "IDS_EXCHANGE",
    "LOOKUP",
    "POOLED_EXCHANGE",
    "UPDATE",
    "PhaseTimes",
    "Timed",
    "timed",
]

IDS_EXCHANGE = "ids_exchange"
LOOKUP = "lookup"
POOLED_EXCHANGE = "pooled_exchange"
GRAD_EXCHANGE = "grad_exchange"
UPDATE = "update"

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T", bound="Timed")


class PhaseTimes:
    """Exclusive seconds per phase name between `start()` and `stop()`; see the module
    docstring. `with times.phase(name): ...` times a phase (nothing while off)."""

    def __init__(
        self, device: torch.device | None = None, clock: Callable[[], float] | None = None
    ) -> None:
        self.device = torch.device("cpu") if device is None else device
        # seconds since some start: the wall clock, or e.g. `time.thread_time` (the calling
        # thread's CPU time: a phase's own work, not its waits or another process's turn)
        self.clock = time.perf_counter if clock is None else clock
        self.on = False
        self.seconds: dict[str, float] = {}
        self._open: list[_Phase] = []  # the phases entered and not yet left, innermost last

    def start(self) -> None:
        """Forget what was recorded and record from now on."""
        self.seconds, self._open, self.on = {}, [], True

    def stop(self) -> dict[str, float]:
        """Stop recording; the seconds recorded since `start()`, per phase."""
        self.on, self._open = False, []  # a phase left open by an error is not counted
        return dict(self.seconds)

    def phase(self, name: str) -> _Phase | _Off:
        return _Phase(self, name) if self.on else _OFF

    def synchronize(self) -> None:
        """Wait for the device's queued work (nothing to wait for on CPU)."""
        if self.device.type not in ("cpu", "meta"):
            torch.accelerator.synchronize(self.device)

    def _enter(self, phase: _Phase) -> None:
        self.synchronize()  # the work queued before belongs to the phase before
        self._open.append(phase)
        phase.started = self.clock()

    def _leave(self, phase: _Phase) -> None:
        self.synchronize()  # this phase's queued work is its own
        elapsed = self.clock() - phase.started
        if not self._open or self._open[-1] is not phase:
            return  # stopped (or restarted) while the phase ran: not this recording's
        self._open.pop()
        self.seconds[phase.name] = self.seconds.get(phase.name, 0.0) + elapsed - phase.inner
        if self._open:
            self._open[-1].inner += elapsed  # the enclosing phase's time excludes this one


class _Phase:
    __slots__ = ("inner", "name", "started", "times")

    def __init__(self, times: PhaseTimes, name: str) -> None:
        self.times, self.name = times, name
        self.started, self.inner = 0.0, 0.0

    def __enter__(self) -> None:
        self.times._enter(self)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.times._leave(self)


class _Off:
    """The phase of a recorder that is off: does nothing (one shared object)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


class Timed(Protocol):
    """An object whose methods `timed` times: it holds the recorder."""

    times: PhaseTimes


def timed(
    name: str,
) -> Callable[[Callable[Concatenate[T, P], R]], Callable[Concatenate[T, P], R]]:
    """Decorate a method of a `Timed` object: each call is the phase `name` of its recorder."""

    def decorate(method: Callable[Concatenate[T, P], R]) -> Callable[Concatenate[T, P], R]:
        @functools.wraps(method)
        def run(self: T, *args: P.args, **kwargs: P.kwargs) -> R:
            with self.times.phase(name):
                return method(self, *args, **kwargs)

        return run

    return decorate
