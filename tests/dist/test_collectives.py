"""Collectives on 2 and 3 real gloo processes, against values computed by hand."""

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
from manualpar.testing import run_distributed


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_on_real_processes(world: int) -> None:
    results = run_distributed(collectives_report, world_size=world)
    for rank, result in enumerate(results):
        prefix = f"ManualParallelStrategy(rank={rank}, world_size={world}"
        assert result.pop("repr").startswith(prefix)
        assert result == expected_report(rank, world)


def _mismatched_gather() -> None:
    strategy = ManualParallelStrategy()
    strategy.all_gather(torch.zeros(2 + strategy.rank))


def test_all_gather_with_mismatched_shapes_names_each_rank() -> None:
    outcomes = run_distributed(_mismatched_gather, world_size=2, allow_failure=True)
    for outcome in outcomes:
        assert outcome.error_type == "CollectiveError"
        assert "rank 0: (2,) torch.float32, rank 1: (3,) torch.float32" in outcome.error


def _checked_reduce() -> None:
    strategy = ManualParallelStrategy(check_collectives=True)
    dtype = torch.float32 if strategy.rank == 0 else torch.float64
    strategy.reduce(torch.zeros(4, dtype=dtype), op="sum")


def test_checked_reduce_reports_dtype_mismatch() -> None:
    outcomes = run_distributed(_checked_reduce, world_size=2, allow_failure=True)
    for outcome in outcomes:
        assert outcome.error_type == "CollectiveError"
        assert "reduce(op=sum)" in outcome.error
        assert "rank 0: (4,) torch.float32, rank 1: (4,) torch.float64" in outcome.error


def _catch_collective_after_teardown_as_runtime_error() -> tuple[str, str]:
    """Code written against plain torch catches RuntimeError: it must see the CollectiveError."""
    strategy = ManualParallelStrategy()
    strategy.teardown()
    try:
        strategy.all_reduce(torch.ones(1), op="sum")
    except RuntimeError as error:
        return type(error).__name__, str(error)
    return "no error", ""


def test_collective_error_is_caught_as_a_runtime_error() -> None:
    for rank, caught in enumerate(
        run_distributed(_catch_collective_after_teardown_as_runtime_error, world_size=2)
    ):
        message = expected_after_teardown(rank)["reduce"]  # all_reduce(op="sum") reduces
        assert caught == ("CollectiveError", message.removeprefix("CollectiveError: "))


def _subgroup_collectives() -> dict | None:
    import torch.distributed as dist

    world = ManualParallelStrategy()
    subgroup = dist.new_group([1, 2])  # every rank must take part in creating it
    if world.rank == 0:
        world.barrier("done")
        return None
    strategy = ManualParallelStrategy(process_group=subgroup)
    result = {
        "rank": strategy.rank,
        "world": strategy.world_size,
        "broadcast": strategy.broadcast(f"from group rank 0 (global {world.rank})", src=0),
        "reduce_to_1": strategy.reduce(torch.tensor([float(world.rank)]), op="sum", dst=1),
    }
    result["reduce_to_1"] = None if result["reduce_to_1"] is None else result["reduce_to_1"].item()
    world.barrier("done")
    return result


def test_adopted_subgroup_uses_group_ranks() -> None:
    _, first, second = run_distributed(_subgroup_collectives, world_size=3, env={"CHECK": "1"})
    assert first == {
        "rank": 0,
        "world": 2,
        "broadcast": "from group rank 0 (global 1)",
        "reduce_to_1": None,
    }
    assert second == {
        "rank": 1,
        "world": 2,
        "broadcast": "from group rank 0 (global 1)",
        "reduce_to_1": 3.0,
    }


def _collective_after_teardown() -> None:
    strategy = ManualParallelStrategy()
    strategy.teardown()
    strategy.all_reduce(torch.ones(1))


def test_collective_after_teardown_raises() -> None:
    outcomes = run_distributed(_collective_after_teardown, world_size=2, allow_failure=True)
    for rank, outcome in enumerate(outcomes):
        assert outcome.error_type == "CollectiveError"
        assert outcome.error.startswith(f"reduce(op=mean) called on rank {rank} after teardown()")


def test_every_collective_after_teardown_raises_as_on_one_process(tmp_path: Path) -> None:
    """The differentiable all_gather and checkpoint save/load used to run on each rank alone."""
    results = run_distributed(after_teardown_errors, world_size=2, args=(str(tmp_path),))
    for rank, outcomes in enumerate(results):
        assert outcomes == expected_after_teardown(rank)
    assert not list(tmp_path.iterdir())  # no checkpoint was written alone


def _teardown_in_finally_after_a_failed_collective() -> str:
    """Rank 1 leaves at once; rank 0's collective fails, and its `finally: teardown()` must
    not replace that error with one from the teardown barrier."""
    strategy = ManualParallelStrategy()
    if strategy.rank == 1:
        return "left"
    try:
        strategy.all_reduce(torch.ones(1), op="sum")
    finally:
        strategy.teardown()
    return "no error"


def test_teardown_after_a_failed_collective_keeps_the_first_error() -> None:
    first, second = run_distributed(
        _teardown_in_finally_after_a_failed_collective, world_size=2, allow_failure=True
    )
    assert second.ok and second.value == "left"
    assert first.error_type == "CollectiveError"
    assert first.error is not None
    assert first.error.startswith("reduce(op=sum, shape=(1,)) failed on rank 0 of 2"), first.error


def test_run_distributed_refuses_a_node_size_that_does_not_divide_the_world() -> None:
    """Refused before any rank starts: a ConfigError, still the ValueError callers catch."""
    with pytest.raises(ConfigError, match="must divide") as refused:
        run_distributed(print, 4, local_world_size=3)
    assert isinstance(refused.value, ValueError)
