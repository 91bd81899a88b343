"""Every error manualpar raises on purpose is a ManualParError that keeps its built-in base.

The scan fails CI on a new `raise ValueError(...)` (or any other bare built-in) in the library;
the cases check the class of raises no other unit test reaches cheaply.
"""

from __future__ import annotations

import ast
import builtins
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import manualpar as mp
from manualpar import errors
from manualpar.checkpoint.local_shards import Block, LocalShards
from manualpar.embeddings.ids.hashing import unsigned_mod
from manualpar.embeddings.kernels import native
from manualpar.embeddings.kernels.bags import add_to_rows
from manualpar.embeddings.sharded.ranking import _check_chunk
from manualpar.embeddings.storage.row_cache import RowCache
from manualpar.loop.metric_objects import compute_metrics
from manualpar.loop.tensorboard_log import require_tensorboard
from manualpar.metrics import LogLoss
from manualpar.nn import CrossNet
from manualpar.strategy.collective_meta import describe
from manualpar.strategy.process_group import pick_device
from manualpar.strategy.timeouts import resolve_timeout
from manualpar.strategy.uneven import all_gather_uneven

PACKAGE = Path(mp.__file__).parent
BUILTIN_ERRORS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}

# Raises known to be waiting for conversion (none now: the planner's stages converted theirs).
NOT_YET: set[tuple[str, str, str]] = set()

# NotImplementedError is allowed anywhere: an abstract member a subclass implements, or an op a
# tensor subclass does not support (torch's convention), never a misuse manualpar reports.
ANYWHERE = {"NotImplementedError"}

# (file, enclosing function, built-in): raises that are not errors manualpar reports.
ALLOWED = {
    # the data-function protocol: StopIteration says "no more batches"
    ("loop/predict.py", "data", "StopIteration"),
    # a module's __getattr__ protocol: an unknown name is the AttributeError hasattr() expects
    ("deprecated.py", "moved", "AttributeError"),
    # raised inside a try that catches it a line later, to share one error message
    ("embeddings/plan.py", "_ranks", "TypeError"),
    ("loop/best_checkpoints.py", "_kept", "TypeError"),
    # an invariant: the step only updates tables this rank holds
    ("embeddings/optim/fused_optimizer.py", "_held", "KeyError"),
    # a file cut during a direct read: the checkpoint reader catches it and names the file
    ("checkpoint/direct.py", "read_into_target", "EOFError"),
    ("checkpoint/direct.py", "_read_exactly", "EOFError"),
    # a test helper's verdict on the run under test, like pytest's own failures
    ("testing.py", "_run_job", "TimeoutError"),
}


def _bare_raises(tree: ast.AST) -> Iterator[tuple[str, str, int]]:
    """(enclosing function, built-in, line) of each `raise <built-in>[(...)]`."""

    def visit(node: ast.AST, function: str) -> Iterator[tuple[str, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, child.name)
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                target = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(target, ast.Name) and target.id in BUILTIN_ERRORS:
                    yield function, target.id, child.lineno
            yield from visit(child, function)

    yield from visit(tree, "<module>")


def test_the_library_raises_no_bare_builtin_error() -> None:
    found, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        for function, error, line in _bare_raises(ast.parse(path.read_text())):
            if error in ANYWHERE:
                continue
            if (name, function, error) in ALLOWED | NOT_YET:
                used.add((name, function, error))
            else:
                found.append(f"manualpar/{name}:{line} ({function}): raise {error}")
    assert found == [], (
        "raise a ManualParError subclass from manualpar/errors.py (it keeps the built-in as a "
        "second base), not a bare built-in:\n" + "\n".join(found)
    )
    assert (ALLOWED | NOT_YET) - used == set(), "allowlist entries that match nothing any more"


def test_every_error_class_keeps_a_builtin_a_caller_would_catch() -> None:
    classes = [
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, mp.ManualParError)
    ]
    for error in classes:
        assert error.__name__ in mp.__all__, error
        if error is mp.ManualParError:
            continue
        bases = {c for c in error.__mro__ if c.__module__ == "builtins"}
        assert bases - {Exception, BaseException, object}, f"{error.__name__}: no built-in base"


class _NotADict:
    def reset(self) -> None:
        pass

    def compute(self, strategy: object) -> list[float]:
        return [1.0]


def _no_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import raises ImportError
    require_tensorboard()


def _no_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "native_kernels", lambda: None)  # not built here
    native.loaded_kernels()


def _one_block(shape: tuple[int, ...]) -> LocalShards:
    return LocalShards(shape, [Block((0,), torch.zeros(shape))], torch.float32)


# (case, class, its built-in, message fragment, the call); monkeypatch is passed to each call
CASES: list[tuple[str, type[Exception], type[Exception], str, Callable[..., object]]] = [
    ("seed", mp.ConfigError, ValueError, "seed must be in", lambda _: mp.seed_everything(-1)),
    ("timeout", mp.ConfigError, ValueError, "must be positive", lambda _: resolve_timeout(0)),
    (
        "uneven",
        mp.ConfigError,
        ValueError,
        "got a scalar",
        lambda _: all_gather_uneven(mp.ManualParallelStrategy(), torch.tensor(1.0)),
    ),
    (
        "meta dims",
        mp.ConfigError,
        ValueError,
        "14 dims",
        lambda _: describe("op", torch.zeros([1] * 15)),
    ),
    ("device", mp.ConfigError, ValueError, "accelerator must be", lambda _: pick_device("tpu", 0)),
    ("cache", mp.ConfigError, ValueError, "policy must be", lambda _: RowCache(4, 2, "fifo")),
    (
        "hash",
        mp.ConfigError,
        ValueError,
        "modulus",
        lambda _: unsigned_mod(torch.zeros(1).long(), 0),
    ),
    (
        "chunk",
        mp.ConfigTypeError,
        TypeError,
        "must be an int",
        lambda _: _check_chunk(1.5),  # type: ignore[arg-type]
    ),
    (
        "best",
        mp.ConfigError,
        ValueError,
        "pass it to a Trainer",
        lambda _: mp.BestCheckpoints("val/x").path(1),
    ),
    (
        "materialize type",
        mp.ConfigTypeError,
        TypeError,
        "expected a strategy",
        lambda _: mp.materialize(nn.Linear(1, 1), 3),  # type: ignore[arg-type]
    ),
    (
        "materialize meta",
        mp.BuilderError,
        ValueError,
        "real device",
        lambda _: mp.materialize(nn.Linear(1, 1), torch.device("meta")),
    ),
    ("cross net", mp.ConfigError, ValueError, "whole number", lambda _: CrossNet(0, 1)),
    (
        "log loss",
        mp.MetricError,
        ValueError,
        "3 labels",
        lambda _: LogLoss().update(torch.ones(2), torch.ones(3)),
    ),
    (
        "compute",
        mp.ConfigTypeError,
        TypeError,
        "returned list",
        lambda _: compute_metrics({"m": _NotADict()}, mp.ManualParallelStrategy()),
    ),
    (
        "local shards",
        mp.CheckpointMismatchError,
        ValueError,
        "does not fit",
        lambda _: _one_block((2,)).copy_from_full(torch.zeros(3), "w"),
    ),
    ("tensorboard", mp.MissingDependencyError, ImportError, "pip install", _no_tensorboard),
    ("kernels", mp.MissingDependencyError, ImportError, "not available", _no_kernels),
    (
        "half rows",
        mp.ConfigError,
        ValueError,
        "needs a RowRounding",
        lambda _: add_to_rows(
            torch.zeros(2, 2, dtype=torch.float16), torch.tensor([0]), torch.ones(1, 2)
        ),
    ),
]


@pytest.mark.parametrize(
    ("error", "builtin", "fragment", "call"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_a_misuse_raises_its_manualpar_class(
    error: type[Exception],
    builtin: type[Exception],
    fragment: str,
    call: Callable[..., object],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(error, match=fragment) as raised:
        call(monkeypatch)
    assert isinstance(raised.value, builtin) and isinstance(raised.value, mp.ManualParError)
