"""Collectives on 1, 2 and 3 real gloo processes, against values computed by hand."""

from __future__ import annotations

import pytest
import torch

from manualpar import CollectiveError, ManualParallelStrategy
from manualpar.testing import run_distributed


def _collectives() -> dict:
    strategy = ManualParallelStrategy()
    rank, world = strategy.rank, strategy.world_size
    x = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    out = {op: strategy.reduce(x, op=op).tolist() for op in ("sum", "mean", "max", "min")}
    out["input_unchanged"] = x.tolist() == [rank + 1.0, 10.0 * (rank + 1)]
    out["int_mean"] = strategy.reduce(torch.tensor(rank), op="mean").item()
    out["int_sum_dtype"] = str(strategy.reduce(torch.tensor(rank), op="sum").dtype)
    out["scalar"] = strategy.all_reduce(float(rank), op="sum").item()
    to_dst = strategy.reduce(x, op="sum", dst=world - 1)
    out["dst"] = None if to_dst is None else to_dst.tolist()
    tensor = torch.full((3,), float(rank))
    out["broadcast_tensor"] = strategy.broadcast(tensor, src=world - 1).tolist()
    out["broadcast_object"] = strategy.broadcast({"from": rank, "list": [rank]}, src=0)
    out["gather"] = strategy.all_gather(torch.tensor([rank, rank * rank])).tolist()
    out["gather_object"] = strategy.all_gather_object(f"r{rank}")
    strategy.barrier("end")
    out["repr"] = repr(strategy)
    strategy.teardown()
    return out


def _expected(rank: int, world: int) -> dict:
    firsts = [r + 1.0 for r in range(world)]
    seconds = [10.0 * (r + 1) for r in range(world)]
    return {
        "sum": [sum(firsts), sum(seconds)],
        "mean": [sum(firsts) / world, sum(seconds) / world],
        "max": [max(firsts), max(seconds)],
        "min": [min(firsts), min(seconds)],
        "input_unchanged": True,
        "int_mean": sum(range(world)) / world,
        "int_sum_dtype": "torch.int64",
        "scalar": float(sum(range(world))),
        "dst": [sum(firsts), sum(seconds)] if rank == world - 1 else None,
        "broadcast_tensor": [float(world - 1)] * 3,
        "broadcast_object": {"from": 0, "list": [0]},
        "gather": [[r, r * r] for r in range(world)],
        "gather_object": [f"r{r}" for r in range(world)],
    }


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_on_real_processes(world: int) -> None:
    results = run_distributed(_collectives, world_size=world)
    for rank, result in enumerate(results):
        prefix = f"ManualParallelStrategy(rank={rank}, world_size={world}"
        assert result.pop("repr").startswith(prefix)
        assert result == _expected(rank, world)


def test_collectives_single_process_without_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    result = _collectives()
    assert result.pop("repr").startswith("ManualParallelStrategy(rank=0, world_size=1")
    assert result == _expected(0, 1)


def test_single_process_rejects_bad_arguments() -> None:
    strategy = ManualParallelStrategy()
    ops = r"\['max', 'mean', 'min', 'sum'\]"
    with pytest.raises(ValueError, match=rf"reduce: op must be one of {ops}, got 'avg'"):
        strategy.reduce(torch.ones(1), op="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"broadcast: rank 1 is not in \[0, 1\)"):
        strategy.broadcast(1, src=1)
    with pytest.raises(ValueError, match=r"reduce: rank 3 is not in \[0, 1\)"):
        strategy.reduce(torch.ones(1), dst=3)


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


def test_collective_error_is_a_runtime_error() -> None:
    assert issubclass(CollectiveError, RuntimeError)


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
