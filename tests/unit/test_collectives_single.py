"""Collectives on one process without a process group, and their argument checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from collective_cases import (
    after_teardown_errors,
    collectives_report,
    expected_after_teardown,
    expected_report,
)

from manualpar import ConfigError, ManualParallelStrategy


def test_collectives_single_process_without_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    result = collectives_report()
    assert result.pop("repr").startswith("ManualParallelStrategy(rank=0, world_size=1")
    assert result == expected_report(0, 1)


def test_single_process_rejects_bad_arguments() -> None:
    strategy = ManualParallelStrategy()
    ops = r"\['max', 'mean', 'min', 'sum'\]"
    with pytest.raises(ConfigError, match=rf"reduce: op must be one of {ops}, got 'avg'"):
        strategy.reduce(torch.ones(1), op="avg")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"broadcast: rank 1 is not in \[0, 1\)"):
        strategy.broadcast(1, src=1)
    with pytest.raises(ValueError, match=r"reduce: rank 3 is not in \[0, 1\)"):
        strategy.reduce(torch.ones(1), dst=3)


def test_differentiable_all_gather_on_one_process_keeps_the_graph() -> None:
    strategy = ManualParallelStrategy()
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    gathered = strategy.all_gather(x, differentiable=True)
    assert gathered.shape == (1, 2)
    (gathered * 3).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [3.0, 3.0]
    assert not strategy.all_gather(x).requires_grad  # the default stays a detached copy


def test_every_collective_after_teardown_raises_on_one_process_as_on_several(
    tmp_path: Path,
) -> None:
    """One process has no group to lose, but a script must fail the same way at any world size
    (tests/dist/test_collectives.py runs the same calls on 2 ranks)."""
    assert after_teardown_errors(str(tmp_path)) == expected_after_teardown(0)
    assert not list(tmp_path.iterdir())  # no checkpoint was written alone
