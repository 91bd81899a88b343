"""zero_optimizer() and the fp16 scaler on one process: the plain optimizer, misuse errors, the
CPU refusal; on a GPU, fp16 fsdp with the sharded scaler. Multi-rank runs: tests/dist/test_zero.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from zero_cases import groups, make_model

import manualpar as mp
from manualpar.builders.fsdp import fsdp
from manualpar.builders.zero import sharded_grad_scaler, zero_optimizer
from manualpar.ownership import mark_replaced
from manualpar.testing import free_port


def test_single_process_gives_the_plain_optimizer() -> None:
    strategy = mp.ManualParallelStrategy()
    model = make_model(0)
    optimizer = zero_optimizer(groups(model), torch.optim.SGD, strategy, lr=0.1)
    assert type(optimizer) is torch.optim.SGD
    assert [len(g["params"]) for g in optimizer.param_groups] == [4, 2]


def test_optimizer_before_setup_is_refused() -> None:
    strategy = mp.ManualParallelStrategy()
    with pytest.raises(
        mp.BuilderError,
        match=r"parameter 0 of shape \(8, 4\) is still on the "
        "meta device. Create the optimizer after model.setup",
    ):
        zero_optimizer(make_model(0, "meta").parameters(), torch.optim.Adam, strategy)
    model = make_model(0)
    mark_replaced([model[4].bias], "fsdp")
    with pytest.raises(mp.BuilderError, match=r"parameter 5 of shape \(2,\) was replaced by"):
        zero_optimizer(model.parameters(), torch.optim.Adam, strategy)
    with pytest.raises(mp.BuilderError, match="got no parameters"):
        zero_optimizer([], torch.optim.Adam, strategy)


def test_fp16_scaler_on_cpu_points_to_bf16() -> None:
    strategy = mp.ManualParallelStrategy(accelerator="cpu")
    with pytest.raises(mp.BuilderError, match=r"fp16 loss scaling needs CUDA.*Use bfloat16"):
        sharded_grad_scaler(strategy)


def test_fp16_fsdp_with_the_sharded_scaler_on_cuda() -> None:
    """A one-rank "cpu:gloo,cuda:nccl" group, so fully_shard and the scaler's all-reduce run."""
    # Checked here, not in a skipif at import: children import this module before they hide
    # the GPU, and an early CUDA query there would leave them half-initialized.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=0, world_size=1)
    try:
        strategy = mp.ManualParallelStrategy(accelerator="cuda")
        model = fsdp(make_model(0, "meta"), strategy, param_dtype=torch.float16, cpu_offload=True)
        for key, value in make_model(0).state_dict().items():  # initialized as on the CPU
            assert torch.equal(model.state_dict()[key].full_tensor().cpu(), value), key
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        scaler = sharded_grad_scaler(strategy, init_scale=2.0**20)
        assert type(scaler).__name__ == "ShardedGradScaler"
        x = torch.randn(8, 4, device="cuda")
        for _ in range(3):
            optimizer.zero_grad()
            scaler.scale(model(x).float().pow(2).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
        assert all(torch.isfinite(p.full_tensor()).all() for p in model.parameters())
        assert type(sharded_grad_scaler(strategy, sharded=False)) is torch.amp.GradScaler
    finally:
        dist.destroy_process_group()
