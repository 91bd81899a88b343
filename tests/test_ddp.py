"""ddp(): equals one process on the full batch, variable batch sizes, ownership, checkpoints.

Ranks are real gloo processes; their results are compared in the parent with a reference computed
on one process over the whole (global) batch. Each rank's work runs in a helper so its DDP modules
are freed before the process group is destroyed (torch's DDP can hang when freed after that).
"""

from __future__ import annotations

import contextlib
import copy
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import manualpar as mp
from manualpar.builders.ddp import GlobalSamplesDDP, ddp, infer_batch_size, set_batch_size
from manualpar.ownership import claim, owner_of
from manualpar.testing import free_port, run_distributed

ATOL = 1e-5
VARIABLE = (3, 7, 1)  # samples per rank, 3 ranks
ACCUMULATE = ((2, 2), (3,), (1, 1, 1))  # per-rank micro-batches (no_sync), equal within a rank
WITH_EMPTY = (4, 0, 2)  # a rank without data forwards an empty batch


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=generator), torch.randn(n, 2, generator=generator)


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {name: p.grad.clone() for name, p in inner.named_parameters()}


def full_batch_grads(n: int, seed: int) -> dict[str, torch.Tensor]:
    model = make_net(0)
    mse(model, *batch(n, seed)).backward()
    return grads(model)


def assert_close(actual: dict, expected: dict, atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=atol)


def train(model: nn.Module, optimizer_name: str, steps: int, rank: int, world: int) -> list:
    """Each rank trains on its 1/world share of every global batch of 8; returns the losses."""
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if optimizer_name == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    share = slice(8 // world * rank, 8 // world * (rank + 1))
    losses = []
    for step in range(steps):
        x, y = batch(8, seed=step)
        optimizer.zero_grad()
        loss = mse(model, x[share], y[share])
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return [losses, optimizer]


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


# ---- in-process: world size 1 and misuse -------------------------------------------------------
def test_world_size_one_returns_the_module_claimed_and_it_trains() -> None:
    strategy = mp.ManualParallelStrategy(accelerator="cpu")
    reference, net = make_net(0), make_net(0)
    model = ddp(net, strategy, normalize_by="global_samples")
    assert model is net and not strategy.is_distributed
    assert {owner_of(p) for p in model.parameters()} == {"ddp"}
    set_batch_size(model, 3)  # nothing to normalize with one process
    train(model, "sgd", 5, rank=0, world=1)
    train(reference, "sgd", 5, rank=0, world=1)
    assert_close(model.state_dict(), reference.state_dict(), atol=0)


def test_ddp_twice_and_meta_parameters_raise() -> None:
    strategy = mp.ManualParallelStrategy(accelerator="cpu")
    with torch.device("meta"):
        net = make_net(0)
    with pytest.raises(
        mp.BuilderError,
        match=re.escape(
            "ddp(): Sequential still has tensors on the meta device (0.weight, 0.bias, 2.weight, "
            "2.bias); call manualpar.meta.materialize on it first"
        ),
    ):
        ddp(net, strategy)
    net.to_empty(device="cpu")
    assert ddp(net, strategy) is net  # the failed call claimed nothing
    with pytest.raises(
        mp.BuilderError,
        match=re.escape(
            "ddp(): module Sequential was already set up by ddp(); call each builder once per "
            "module, on disjoint submodules"
        ),
    ):
        ddp(net, strategy)


def test_misuse_is_named_and_batch_sizes_are_inferred() -> None:
    strategy = mp.ManualParallelStrategy(accelerator="cpu")
    with pytest.raises(mp.BuilderError, match="must be 'world_size' or 'global_samples', got 'x'"):
        ddp(make_net(0), strategy, normalize_by="x")  # type: ignore[arg-type]
    owned = make_net(0)
    claim(owned[0], "fsdp")
    claim(owned[2], "shard_embeddings")
    with pytest.raises(
        mp.BuilderError,
        match=r"no trainable parameter left for DDP \(owned by "
        r"other builders: fsdp, shard_embeddings; frozen: 0\)",
    ):
        ddp(owned, strategy)
    plain = ddp(make_net(0), strategy)
    with pytest.raises(mp.BuilderError, match="has no part wrapped with ddp"):
        set_batch_size(plain, 4)
    with pytest.raises(mp.BuilderError, match=r"n must be an integer >= 0, got -1"):
        set_batch_size(plain, -1)
    x = torch.zeros(5, 3)
    assert infer_batch_size((x,), {}) == 5
    assert infer_batch_size((), {"features": {"dense": [x]}}) == 5
    assert infer_batch_size(("ids", 3, (x[:2],)), {}) == 2
    with pytest.raises(mp.BuilderError, match=r"inputs hold no tensor; call set_batch_size"):
        infer_batch_size(("text",), {"n": 3})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_move_and_global_samples_on_nccl() -> None:
    """The module moves to the rank's GPU; a one-rank nccl group runs the comm hook."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    try:
        strategy = mp.ManualParallelStrategy(accelerator="cuda")
        model = ddp(make_net(0), strategy, normalize_by="global_samples")
        assert isinstance(model, GlobalSamplesDDP)
        assert {p.device for p in model.parameters()} == {strategy.device}
        x, y = batch(6, seed=5)
        mse(model, x.cuda(), y.cuda()).backward()
        assert_close({k: v.cpu() for k, v in grads(model).items()}, full_batch_grads(6, seed=5))
        del model
    finally:
        dist.destroy_process_group()
