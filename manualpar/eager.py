"""`eager_only`: run a function outside torch.compile's graphs, without importing the compiler.

`torch.compiler.disable` imports torch._dynamo when it decorates, at import time: about 0.5 s of
CPU (and much more wall on a loaded machine) paid by every process that imports manualpar,
compiled or not. This decorator defers that to the first call: the decorated function is
wrapped by `torch.compiler.disable` then, and later calls go straight to the wrapped one. A
compiled caller sees the same graph break either way (torch's own `_disable_dynamo` works the
same way). Until something imports torch._dynamo, nothing can be compiling (torch.compile
imports it before it traces), so calls go straight to the function: a job's first batch and step
then pay no compiler import (building the first `SparseFeatures` took 0.77-0.86 s of CPU, now
0.0004 s; 3 pairs of fresh processes).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["eager_only"]

P = ParamSpec("P")
R = TypeVar("R")


def eager_only(reason: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """`@torch.compiler.disable(reason=reason)`, applied at the first call."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        disabled: list[Callable[P, R]] = []

        @functools.wraps(fn)
        def run_eagerly(*args: P.args, **kwargs: P.kwargs) -> R:
            if not disabled:
                if "torch._dynamo" not in sys.modules:  # no compiler loaded: nothing compiling
                    return fn(*args, **kwargs)
                import torch.compiler

                disabled.append(torch.compiler.disable(fn, reason=reason))
            return disabled[0](*args, **kwargs)

        return run_eagerly

    return decorate
