"""Checkpoint IO across ranks: a failure on one rank becomes the same error on every rank.

Saving and loading run steps that can fail on one rank only (a full disk, a corrupted file). Each
step's outcome is exchanged, so every rank raises the same CheckpointError naming the rank that
failed, instead of the others waiting in the next collective until the timeout. The strategy is
used through `Ranks`, the little of it checkpoint IO needs, so this layer never imports it.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch.distributed as dist

from manualpar.checkpoint.files import describe_failure
from manualpar.errors import CheckpointError, CollectiveError

__all__ = ["OnGroup", "Ranks", "agree", "agree_on_path", "dcp_call"]

T = TypeVar("T")
log = logging.getLogger("manualpar.checkpoint")


class Ranks(Protocol):
    """What checkpoint IO needs from the strategy."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_distributed(self) -> bool: ...

    @property
    def is_global_zero(self) -> bool: ...

    group: dist.ProcessGroup | None

    def all_gather_object(self, obj: Any, *, group: Any = None) -> list[Any]: ...

    def collective_guard(self, operation: str) -> AbstractContextManager[None]: ...


class OnGroup:
    """The strategy's ranks, with every collective over `group` instead of its main group: a
    background save talks over a group of its own, so its collectives never interleave with
    the training's on the main group."""

    def __init__(self, strategy: Ranks, group: dist.ProcessGroup | None) -> None:
        self.strategy, self.group = strategy, group

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_distributed(self) -> bool:
        return self.strategy.is_distributed and self.group is not None

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    def all_gather_object(self, obj: Any, *, group: Any = None) -> list[Any]:
        return self.strategy.all_gather_object(obj, group=group or self.group)

    def collective_guard(self, operation: str) -> AbstractContextManager[None]:
        return self.strategy.collective_guard(operation)


def agree(
    strategy: Ranks,
    what: str,
    fn: Callable[[], T],
    *,
    same_path: tuple[str, Path] | None = None,
) -> T:
    """Run `fn` on every rank; raise on all of them if it failed on any (naming the first).

    `same_path=(operation, path)`: also check, in the same collective, that every rank passed
    this path (see `agree_on_path`); a difference is reported before any rank's failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    result: Any = None
    local_error: BaseException | None = None
    try:
        result = fn()
    except (Exception, CheckpointException) as error:
        local_error = error
    report = None if local_error is None else describe_failure(local_error)
    path = None if same_path is None else str(same_path[1])
    if strategy.is_distributed:
        try:
            gathered = strategy.all_gather_object((report, path))  # one collective
        except CollectiveError as error:  # a peer died or stalled: say what was going on
            raise CollectiveError(f"{what}: {error}") from error
    else:
        gathered = [(report, path)]
    if same_path is not None:
        _check_same_paths(same_path[0], [str(p) for _, p in gathered])
    failed = [(rank, message) for rank, (message, _) in enumerate(gathered) if message is not None]
    if not failed:
        return result
    if isinstance(local_error, CheckpointError):
        raise local_error
    rank, message = failed[0]
    raise CheckpointError(f"{what} failed on rank {rank}: {message}") from local_error


def agree_on_path(strategy: Ranks, operation: str, path: Path) -> None:
    """Refuse on every rank, before anything is written, unless every rank passed the same
    path: a per-rank name or a timestamp in it would let rank 0 commit a checkpoint holding its
    own shards only, which fails only when loaded."""
    if strategy.is_distributed:
        agree(strategy, f"{operation}({path})", lambda: None, same_path=(operation, path))


def _check_same_paths(operation: str, paths: list[str]) -> None:
    if len(set(paths)) > 1:
        described = ", ".join(f"rank {rank}: {path}" for rank, path in enumerate(paths))
        raise CheckpointError(
            f"{operation}: the ranks passed different paths ({described}); every rank must pass "
            "the same path (build it from the step, not from the rank or the clock, or "
            "broadcast rank 0's); nothing was written or loaded"
        )


def dcp_call(strategy: Ranks, operation: str, fn: Callable[[], Any]) -> None:
    """Run a DCP call; a dead or stalled peer surfaces as CollectiveError naming the operation."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with strategy.collective_guard(operation), warnings.catch_warnings():
            # Without a process group DCP warns that it assumes one process: that is intended.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            fn()
    except CheckpointException as error:
        log.debug("%s failed: %s", operation, error)  # with every failing rank's traceback
        raise CheckpointError(f"{operation} failed {_by_rank(error.failures)}") from None


def _by_rank(failures: dict[int, Any]) -> str:
    """'on rank 1: no space left on device: ...' from DCP's failures (one line per rank, not
    DCP's tracebacks)."""
    lines = {
        rank: describe_failure(failure[0] if isinstance(failure, tuple) else failure)
        for rank, failure in sorted(failures.items())
    }
    if len(lines) == 1:
        rank, line = next(iter(lines.items()))
        return f"on rank {rank}: {line}"
    return f"on ranks {', '.join(map(str, lines))}: " + "; ".join(
        f"rank {rank}: {line}" for rank, line in lines.items()
    )
