"""The CUDA/NCCL path: device placement, collectives through nccl, checkpoints of CUDA tensors.

These run only where a GPU is present (CI has none and skips them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_models import make_model, train

import manualpar as mp
from manualpar.testing import free_port

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU/gloo path is tested elsewhere)"
)


@pytest.fixture
def cuda_group() -> mp.ManualParallelStrategy:
    """A one-rank "cpu:gloo,cuda:nccl" group adopted by the strategy, so nccl really runs."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    strategy = mp.ManualParallelStrategy(accelerator="cuda")
    yield strategy
    dist.destroy_process_group()


def test_strategy_picks_the_local_gpu() -> None:
    strategy = mp.ManualParallelStrategy()
    assert strategy.device == torch.device("cuda", 0)
    assert strategy.backend == "cpu:gloo,cuda:nccl"
    assert strategy.reduce(2.0, op="sum").device == strategy.device


def test_collectives_through_nccl(cuda_group: mp.ManualParallelStrategy) -> None:
    strategy = cuda_group
    assert strategy.is_distributed
    x = torch.arange(4.0, device="cuda")
    assert strategy.all_reduce(x, op="sum").tolist() == [0.0, 1.0, 2.0, 3.0]
    assert strategy.all_reduce(x.cpu(), op="max").device.type == "cpu"  # via gloo
    assert strategy.all_gather(x).shape == (1, 4)
    assert strategy.broadcast({"a": 1}) == {"a": 1}
    assert strategy.broadcast(x.clone()).tolist() == x.tolist()
    strategy.barrier("cuda")


def test_checkpoint_of_cuda_model(cuda_group: mp.ManualParallelStrategy, tmp_path: Path) -> None:
    strategy = cuda_group
    model = make_model(seed=0).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        loss = model(torch.randn(8, 4, generator=generator).cuda()).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    strategy.save_checkpoint(tmp_path / "c", {"model": model, "optim": optimizer, "step": 2})
    strategy.save_checkpoint(tmp_path / "full.pt", {"model": model}, full=True)
    fresh = make_model(seed=5).cuda()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    state = {"model": fresh, "optim": fresh_optimizer, "step": 0}
    strategy.load_checkpoint(tmp_path / "c", state)
    assert state["step"] == 2
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert a.device.type == "cuda"
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    blob = torch.load(tmp_path / "full.pt", weights_only=True)
    assert blob["model"]["0.weight"].device.type == "cpu"
    cpu_model = make_model(seed=3)
    train(cpu_model, torch.optim.SGD(cpu_model.parameters(), lr=0.0), steps=0)
    cpu_model.load_state_dict(blob["model"])
    torch.testing.assert_close(cpu_model[0].weight, model[0].weight.cpu(), rtol=0, atol=0)
