"""bench_compile.py's compiled steps use the backend asked for (`--backend`), here with
torch.compile replaced: nothing is compiled. tests/e2e/test_bench_compile.py runs the benchmark."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from example_modules import load_example


def _bench_compile(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the benchmark puts the example on it
    metrics = load_example(Path("recsys/metrics.py"), "bench_compile_test_metrics")
    siblings = {
        "bench_common": load_example(Path("benchmarks/bench_common.py"), "bench_compile_common"),
        "data": load_example(Path("recsys/data.py"), "bench_compile_test_data"),
        "model": load_example(
            Path("recsys/model.py"), "bench_compile_test_model", {"metrics": metrics}
        ),
    }
    return load_example(Path("benchmarks/bench_compile.py"), "bench_compile_test", siblings)


def test_the_compiled_steps_use_the_backend_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench_compile(monkeypatch)
    compiled: list[tuple[Any, dict]] = []

    def fake_compile(fn: Any, **options: Any) -> Any:
        compiled.append((fn, options))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = SimpleNamespace(tables=["t"], dim=4, dense_forward=lambda dense, pooled: pooled)
    batches = [_Batch()]
    bench.make_steps(model, None, batches, compiled=False)
    assert compiled == []
    bench.make_steps(model, None, batches, compiled=True, backend="aot_eager")
    assert compiled == [
        (model, {"backend": "aot_eager"}),
        (model.dense_forward, {"backend": "aot_eager"}),
    ]


class _Batch:
    dense = torch.zeros(3, 2)

    def __len__(self) -> int:
        return 3
