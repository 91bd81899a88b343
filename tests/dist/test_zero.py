"""zero_optimizer() on 2 real gloo processes against plain Adam: its sharded state, the reload
from a consolidated state, sharded or replaced parameters refused (one process, misuse and the
fp16 scaler: tests/unit/test_zero_single.py).

The ZeRO runs use torch's DDP, or a plain model whose gradients are all-reduced by hand, with
half of each global batch per rank; the parent replays the full batch with a plain Adam.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from zero_cases import groups, make_model

import manualpar as mp
from manualpar.builders.fsdp import fsdp
from manualpar.builders.zero import zero_optimizer
from manualpar.testing import run_distributed

BATCH, STEPS = 8, 3


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [
        (torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 2, generator=generator))
        for _ in range(STEPS)
    ]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world: int,
    all_reduce: Any = None,
) -> None:
    half = BATCH // world
    for x, y in batches():
        rows = slice(rank * half, (rank + 1) * half)
        loss = (model(x[rows]) - y[rows]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        if all_reduce is not None:
            for param in model.parameters():
                param.grad = all_reduce(param.grad)
        optimizer.step()


def _zero_runs() -> dict[str, Any]:
    strategy = mp.ManualParallelStrategy()
    rank, world = strategy.rank, strategy.world_size
    results: dict[str, Any] = {}
    ddp = DistributedDataParallel(make_model(0), process_group=strategy.group)
    optimizer = zero_optimizer(ddp.parameters(), torch.optim.Adam, strategy, lr=0.01)
    train(ddp, optimizer, rank, world)
    local = optimizer.optim.state_dict()["state"]  # type: ignore[attr-defined]
    results["ddp"] = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    results["optimizer_type"] = type(optimizer).__name__
    results["local_states"] = len(local)
    results["local_exp_avg"] = {i: entry["exp_avg"].clone() for i, entry in local.items()}
    # The torch way to checkpoint: consolidate on rank 0, then any rank loads the full state.
    optimizer.consolidate_state_dict(to=0)
    full = strategy.broadcast(optimizer.state_dict() if rank == 0 else None)
    fresh = zero_optimizer(ddp.parameters(), torch.optim.Adam, strategy, lr=0.5)
    fresh.load_state_dict(full)
    reloaded = fresh.optim.state_dict()["state"]  # type: ignore[attr-defined]
    results["reloaded_exp_avg"] = {i: entry["exp_avg"].clone() for i, entry in reloaded.items()}
    results["reload_lr"] = fresh.param_groups[0]["lr"]

    plain = make_model(0)
    optimizer = zero_optimizer(groups(plain), torch.optim.Adam, strategy, lr=0.01)
    train(plain, optimizer, rank, world, all_reduce=strategy.all_reduce)
    results["groups"] = {k: v.detach().clone() for k, v in plain.state_dict().items()}

    sharded = make_model(0)
    before = list(sharded.parameters())
    fsdp(sharded, strategy)
    for label, params in {"dtensor": sharded.parameters(), "replaced": before}.items():
        try:
            zero_optimizer(params, torch.optim.Adam, strategy)
            results[label] = "no error"
        except mp.BuilderError as error:
            results[label] = str(error)
    strategy.teardown()
    return results


def reference(with_groups: bool) -> dict[str, torch.Tensor]:
    model = make_model(0)
    optimizer = torch.optim.Adam(groups(model) if with_groups else model.parameters(), lr=0.01)
    train(model, optimizer, rank=0, world=1)
    return model.state_dict()


@pytest.fixture(scope="module")
def zero_results() -> list[dict[str, Any]]:
    return run_distributed(_zero_runs, world_size=2)


@pytest.mark.parametrize("setup", ["ddp", "groups"])
def test_zero_matches_plain_adam(zero_results: list[dict[str, Any]], setup: str) -> None:
    expected = reference(with_groups=setup == "groups")
    for rank in range(2):
        for key, value in expected.items():
            torch.testing.assert_close(
                zero_results[rank][setup][key],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=f"rank {rank} {key}",
            )


def test_state_is_sharded_and_reloads_from_consolidated(zero_results: list[dict[str, Any]]) -> None:
    counts = [result["local_states"] for result in zero_results]
    assert [r["optimizer_type"] for r in zero_results] == ["ZeroRedundancyOptimizer"] * 2
    assert sum(counts) == 6 and all(0 < count < 6 for count in counts)  # 6 parameters in all
    for rank, result in enumerate(zero_results):
        # this rank's shard of the state, as reloaded from the consolidated (full) state dict
        assert sorted(result["reloaded_exp_avg"]) == sorted(result["local_exp_avg"]), rank
        for index, exp_avg in result["local_exp_avg"].items():
            torch.testing.assert_close(
                result["reloaded_exp_avg"][index],
                exp_avg,
                rtol=0,
                atol=0,
                msg=f"rank {rank}: exp_avg of parameter {index}",
            )
        assert result["reload_lr"] == 0.01


def test_zero_refuses_sharded_and_replaced_params(zero_results: list[dict[str, Any]]) -> None:
    result = zero_results[0]
    assert "is sharded (a DTensor" in result["dtensor"]
    assert "was replaced by fsdp()" in result["replaced"]
