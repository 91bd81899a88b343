"""ddp() on one process: world size 1 returns the module, misuse is named, batch sizes are
inferred; on a GPU, the one-rank nccl path. The multi-rank runs are in tests/dist/test_ddp.py."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from ddp_cases import assert_close, batch, full_batch_grads, grads, make_net, mse, train

import manualpar as mp
from manualpar.builders.ddp import GlobalSamplesDDP, ddp, infer_batch_size, set_batch_size
from manualpar.ownership import claim, owner_of
from manualpar.testing import free_port


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
