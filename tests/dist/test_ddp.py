"""ddp(): equals one process on the full batch, variable batch sizes, ownership, checkpoints.

Ranks are real gloo processes; their results are compared in the parent with a reference computed
on one process over the whole (global) batch. Each rank's work runs in a helper so its DDP modules
are freed before the process group is destroyed (torch's DDP can hang when freed after that).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import pytest
import torch
from ddp_cases import ATOL, assert_close, batch, full_batch_grads, grads, make_net, mse, train
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import manualpar as mp
from manualpar.builders.ddp import GlobalSamplesDDP, ddp, set_batch_size
from manualpar.ownership import claim, owner_of
from manualpar.testing import run_distributed

VARIABLE = (3, 7, 1)  # samples per rank, 3 ranks
ACCUMULATE = ((2, 2), (3,), (1, 1, 1))  # per-rank micro-batches (no_sync), equal within a rank
WITH_EMPTY = (4, 0, 2)  # a rank without data forwards an empty batch


def _on_ranks(work: str, *args: object) -> dict:
    """Run `work(strategy, *args)`; named by string, since run_distributed unpickles args before
    it hides the GPUs (a function would import this module, which asks CUDA, too early)."""
    strategy = mp.ManualParallelStrategy(accelerator="cpu")
    try:
        return globals()[work](strategy, *args)
    finally:
        strategy.teardown()


# ---- 2 ranks, each with half of the global batch, train like one process on all of it ----------
def _train_two_ranks(strategy: mp.ManualParallelStrategy) -> dict:
    result = {}
    for name in ("sgd", "adam"):
        model = ddp(make_net(0), strategy)
        assert type(model) is DistributedDataParallel
        losses, _ = train(model, name, 5, strategy.rank, 2)
        result[name] = {
            "losses": [strategy.all_reduce(loss).item() for loss in losses],
            "params": dict(model.module.state_dict()),
            "owners": {owner_of(p) for p in model.parameters()},
        }
    return result


@pytest.fixture(scope="module")
def two_rank_training() -> list[dict]:
    return run_distributed(_on_ranks, world_size=2, args=("_train_two_ranks",))


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_two_ranks_equal_one_process_on_the_full_batch(
    two_rank_training: list[dict], name: str
) -> None:
    reference = make_net(0)
    losses = [loss.item() for loss in train(reference, name, 5, rank=0, world=1)[0]]
    for result in two_rank_training:
        assert result[name]["owners"] == {"ddp"}
        assert result[name]["losses"] == pytest.approx(losses, abs=ATOL)
        assert_close(result[name]["params"], reference.state_dict())


# ---- variable per-rank batch sizes on 3 ranks ---------------------------------------------------
class Transposed(nn.Sequential):
    """Takes (features, batch): the batch size cannot be inferred from the first dimension."""

    def forward(self, xt: torch.Tensor) -> torch.Tensor:
        return super().forward(xt.t())


def _step(model: nn.Module, rank: int, sizes: tuple[int, ...], seed: int) -> dict:
    """One backward on this rank's share of a global batch split as `sizes`."""
    x, y = batch(sum(sizes), seed)
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    if isinstance(model.module, Transposed):  # inference would say 4 (the feature count)
        set_batch_size(model, len(y[mine]))
    inputs = x[mine].t() if isinstance(model.module, Transposed) else x[mine]
    (model(inputs) - y[mine]).pow(2).mean().backward()  # an empty share gives a NaN loss
    return grads(model)


def _variable_batches(strategy: mp.ManualParallelStrategy) -> dict:
    rank, out = strategy.rank, {}
    for mode in ("global_samples", "world_size"):
        model = ddp(make_net(0), strategy, normalize_by=mode)
        out[mode], out[f"{mode}_type"] = _step(model, rank, VARIABLE, seed=5), type(model)
    out["with_empty"] = _step(
        ddp(make_net(0), strategy, normalize_by="global_samples"), rank, WITH_EMPTY, seed=7
    )
    out["explicit"] = _step(
        ddp(Transposed(*make_net(0)), strategy, normalize_by="global_samples"),
        rank,
        VARIABLE,
        seed=5,
    )
    accumulated = ddp(make_net(0), strategy, normalize_by="global_samples")
    x, y = batch(sum(map(sum, ACCUMULATE)), seed=6)
    start, micros = sum(map(sum, ACCUMULATE[:rank])), ACCUMULATE[rank]
    for i, size in enumerate(micros):  # the last one synchronizes
        mine = slice(start + i * size, start + (i + 1) * size)
        with accumulated.no_sync() if i < len(micros) - 1 else contextlib.nullcontext():
            (mse(accumulated, x[mine], y[mine]) / len(micros)).backward()
    out["accumulated"] = grads(accumulated)
    return out


@pytest.fixture(scope="module")
def variable_batches() -> list[dict]:
    return run_distributed(_on_ranks, world_size=3, args=("_variable_batches",))


def test_global_samples_gives_the_full_batch_gradient(variable_batches: list[dict]) -> None:
    reference = full_batch_grads(sum(VARIABLE), seed=5)
    for result in variable_batches:
        assert result["global_samples_type"] is GlobalSamplesDDP
        assert result["world_size_type"] is DistributedDataParallel
        assert_close(result["global_samples"], reference)
        assert_close(result["explicit"], reference)


def test_world_size_normalization_does_not(variable_batches: list[dict]) -> None:
    reference = full_batch_grads(sum(VARIABLE), seed=5)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_close(variable_batches[0]["world_size"], reference, atol=1e-3)


def test_no_sync_accumulation_and_empty_batches(variable_batches: list[dict]) -> None:
    for result in variable_batches:
        assert_close(result["accumulated"], full_batch_grads(sum(map(sum, ACCUMULATE)), seed=6))
        assert_close(result["with_empty"], full_batch_grads(sum(WITH_EMPTY), seed=7))


# ---- ownership: parameters of another builder are not synchronized ------------------------------
def _ownership(strategy: mp.ManualParallelStrategy) -> dict:
    model = make_net(0)
    torch.manual_seed(100 + strategy.rank)
    model[2].reset_parameters()  # each rank its own head: DDP must not broadcast it either
    head = model[2].weight.detach().clone()
    x, y = batch(4, seed=10 + strategy.rank)  # different data per rank
    local = copy.deepcopy(model)
    mse(local, x, y).backward()
    claim(model[2], "fsdp")
    wrapped = ddp(model, strategy)
    mse(wrapped, x, y).backward()
    with pytest.raises(mp.BuilderError) as caught:
        ddp(wrapped, strategy)
    return {
        "local": grads(local),
        "ddp": grads(wrapped),
        "head": head,
        "error": str(caught.value),
        "head_after": model[2].weight.detach().clone(),
        "owners": [owner_of(p) for p in model.parameters()],
    }


def test_parameters_owned_by_another_builder_are_left_out() -> None:
    ranks = run_distributed(_on_ranks, world_size=2, args=("_ownership",))
    assert not torch.equal(ranks[0]["head"], ranks[1]["head"])
    assert not torch.equal(ranks[0]["ddp"]["2.weight"], ranks[1]["ddp"]["2.weight"])
    for result in ranks:
        assert result["owners"] == ["ddp", "ddp", "fsdp", "fsdp"]
        assert torch.equal(result["head_after"], result["head"])
        for key in ("2.weight", "2.bias"):  # this rank's own gradient, not averaged
            assert torch.equal(result["ddp"][key], result["local"][key])
        for key in ("0.weight", "0.bias"):  # averaged over the ranks
            mean = (ranks[0]["local"][key] + ranks[1]["local"][key]) / 2
            torch.testing.assert_close(result["ddp"][key], mean, rtol=0, atol=ATOL)
        assert result["error"] == (
            "ddp(): the module is already a DistributedDataParallel "
            "(around Sequential); call ddp() once per module"
        )


# ---- checkpoint: saved by a ddp model on 2 ranks, loaded into a plain module on 1 ---------------
def _save_ddp_checkpoint(strategy: mp.ManualParallelStrategy, path: str) -> dict:
    model = ddp(make_net(0), strategy)
    _, optimizer = train(model, "adam", 3, strategy.rank, 2)
    strategy.save_checkpoint(path, {"model": model, "optim": optimizer, "step": 3})
    return {"params": dict(model.module.state_dict()), "optim": optimizer.state_dict()["state"]}


def test_checkpoint_from_two_ddp_ranks_loads_into_a_plain_module(tmp_path: Path) -> None:
    saved = run_distributed(
        _on_ranks, world_size=2, args=("_save_ddp_checkpoint", str(tmp_path / "c"))
    )
    model = make_net(seed=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    state = {"model": model, "optim": optimizer, "step": 0}
    mp.ManualParallelStrategy(accelerator="cpu").load_checkpoint(tmp_path / "c", state)
    assert state["step"] == 3 and optimizer.param_groups[0]["lr"] == 0.01
    for result in saved:
        assert_close(model.state_dict(), result["params"], atol=0)
        for i, entry in optimizer.state_dict()["state"].items():
            assert_close(entry, result["optim"][i], atol=0)
