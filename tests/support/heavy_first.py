"""The suite's order over pytest-xdist workers under `--dist loadscope`: launched jobs first.

xdist's loadscope hands out test files (scopes) by their number of tests, most first, so a file
of one or two tests goes last; in tests/e2e those are the long ones (a benchmark or a killed and
restarted job, 10-25 s each). One of them started at the end kept one worker busy while the
other had nothing left: measured on 2 workers, about 30 s of the suite's wall time. Here the
files of tests/e2e go first, then tests/dist, then tests/unit (many files of under a second,
which fill both workers up to the end); within a folder, xdist's order.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

FOLDERS = ("tests/e2e/", "tests/dist/")  # in this order, before every other file


def folder_rank(scope: str) -> int:
    """0 for a file of tests/e2e, 1 for tests/dist, 2 for any other."""
    return next((i for i, folder in enumerate(FOLDERS) if scope.startswith(folder)), len(FOLDERS))


class HeavyFirstQueue(OrderedDict):
    """xdist's work queue (scope -> its tests), popped in folder order, then in its own."""

    def popitem(self, last: bool = True) -> tuple[str, Any]:
        if last:
            return super().popitem(last=True)
        scope = min(self, key=folder_rank)  # the first of the lowest rank, in xdist's order
        return scope, self.pop(scope)


def make_scheduler(config: Any, log: Any) -> Any:
    """xdist's LoadScopeScheduling with a HeavyFirstQueue."""
    from xdist.scheduler import LoadScopeScheduling

    scheduler = LoadScopeScheduling(config, log)
    scheduler.workqueue = HeavyFirstQueue()
    return scheduler
