"""fsdp() on 2 real gloo processes against a single-process full-batch reference.

One distributed run trains every option variant (each rank gets half of each global batch) and
reports the all-reduced losses and the gathered full parameters; the parent replays the same
steps in one process. Further runs cover meta init, ownership, errors and checkpoints.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from fsdp_cases import DIM, Block, Net, make_net
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule

import manualpar as mp
from manualpar.builders.fsdp import fsdp
from manualpar.ownership import claim, owner_of, replaced_by
from manualpar.testing import run_distributed

BATCH, STEPS, LR = 8, 3, 0.01
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(BATCH, 5, generator=generator), torch.randn(BATCH, 3, generator=generator))
        for _ in range(STEPS)
    ]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


VARIANTS: dict[str, Callable[[Net], dict[str, Any]]] = {
    "default": lambda m: {},
    "no_reshard": lambda m: {"reshard_after_forward": False},
    "cpu_offload": lambda m: {"cpu_offload": True},
    "auto_wrap": lambda m: {"min_num_params": 50},
    "wrap_class": lambda m: {"wrap": (Block,)},
    "wrap_list": lambda m: {"wrap": [m.blocks[0], m.out]},
    "bf16": lambda m: {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "meta": lambda m: {"wrap": (Block,)},
}
BLOCKS = {
    "auto_wrap": ["blocks.0", "blocks.1"],
    "wrap_class": ["blocks.0", "blocks.1"],
    "wrap_list": ["blocks.0", "out"],
    "meta": ["blocks.0", "blocks.1"],
}


# ---- children ----------------------------------------------------------------------------
def _train(model: nn.Module, strategy: mp.ManualParallelStrategy) -> tuple[list[float], Any]:
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    half = BATCH // strategy.world_size
    losses = []
    for x, y in batches():
        rows = slice(strategy.rank * half, (strategy.rank + 1) * half)
        loss = loss_fn(model(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(strategy.all_reduce(loss.detach()).item())
    return losses, optimizer


def _variants() -> dict[str, Any]:
    strategy = mp.ManualParallelStrategy()
    results: dict[str, Any] = {}
    for name, options in VARIANTS.items():
        model = make_net(0, "meta" if name == "meta" else "cpu")
        fsdp(model, strategy, **options(model))
        initial = get_model_state_dict(model, options=FULL)
        losses, _ = _train(model, strategy)
        results[name] = {
            "losses": losses,
            "params": get_model_state_dict(model, options=FULL),
            "initial": initial,
            "param_types": sorted({type(p).__name__ for p in model.parameters()}),
            "blocks": [n for n, m in model.named_modules() if isinstance(m, FSDPModule) and n],
        }
    strategy.teardown()
    return results


def _ownership_and_errors() -> dict[str, Any]:
    strategy = mp.ManualParallelStrategy()
    model = make_net(0)
    kept = model.out.weight
    before = kept.detach().clone()
    claim(model.out, "other")
    old_inp = model.inp.weight
    fsdp(model, strategy)
    result = {
        "out_type": type(model.out.weight).__name__,
        "out_ids": (id(model.out.weight), id(kept)),  # the very same Parameter object
        "out_before": before,
        "out_after_fsdp": model.out.weight.detach().clone(),
        "out_owner": owner_of(model.out.weight),
        "inp_owner": owner_of(model.inp.weight),
        "inp_type": type(model.inp.weight).__name__,
        "old_replaced": replaced_by(old_inp),
        "out_replaced": replaced_by(kept),
    }
    _, _ = _train(model, strategy)  # the ignored plain parameter trains alongside the shards
    for label, call in {
        "twice": lambda: fsdp(model, strategy),
        "block_twice": lambda: fsdp(model.blocks[0], strategy),
    }.items():
        try:
            call()
            result[label] = "no error"
        except mp.BuilderError as error:
            result[label] = str(error)
    # A meta model whose `out` another builder already materialized: kept as is.
    meta = make_net(0, "meta")
    meta.out = nn.Linear(DIM, 3)
    claim(meta.out, "other")
    out_before = meta.out.weight.detach().clone()
    fsdp(meta, strategy, wrap=(Block,))
    result["meta_out_before"] = out_before
    result["meta_out_after"] = meta.out.weight.detach().clone()
    nested = make_net(0)  # a block first, then its parent: fully_shard's own nesting
    fsdp(nested.blocks[1], strategy)
    fsdp(nested, strategy)
    result["nested_blocks"] = [
        n for n, m in nested.named_modules() if isinstance(m, FSDPModule) and n
    ]
    _train(nested, strategy)
    result["nested_params"] = get_model_state_dict(nested, options=FULL)
    result["meta_left"] = [n for n, p in meta.named_parameters() if p.is_meta]
    strategy.teardown()
    return result


def _save(directory: str) -> dict[str, Any]:
    strategy = mp.ManualParallelStrategy()
    model = fsdp(make_net(0), strategy, wrap=(Block,))
    _, optimizer = _train(model, strategy)
    strategy.save_checkpoint(
        Path(directory) / "fsdp", {"model": model, "optim": optimizer, "step": STEPS}
    )
    result = {
        "params": get_model_state_dict(model, options=FULL),
        "optim": get_optimizer_state_dict(model, optimizer, options=FULL),
    }
    strategy.teardown()
    return result


def _load(path: str) -> dict[str, Any]:
    strategy = mp.ManualParallelStrategy()
    model = fsdp(make_net(3), strategy, wrap=(Block,))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    loaded = strategy.load_checkpoint(path, {"model": model, "optim": optimizer, "step": 0})
    result = {
        "params": get_model_state_dict(model, options=FULL),
        "step": loaded["step"],
        "optim": get_optimizer_state_dict(model, optimizer, options=FULL),
    }
    strategy.teardown()
    return result


# ---- single-process reference ------------------------------------------------------------
@functools.cache
def reference(param_dtype: torch.dtype | None = None) -> tuple[list[float], dict[str, Any]]:
    """Each half-batch's gradient computed separately and averaged, as on 2 ranks; with
    `param_dtype`, forward and backward run on low-precision copies (as FSDP2 does)."""
    model = make_net(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for x, y in batches():
        grads: list[list[torch.Tensor]] = []
        step_loss = 0.0
        for rows in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            params = {n: p.to(param_dtype or p.dtype) for n, p in model.named_parameters()}
            out = torch.func.functional_call(model, params, (x[rows].to(param_dtype or x.dtype),))
            loss = loss_fn(out, y[rows])
            grads.append([g.float() for g in torch.autograd.grad(loss, list(model.parameters()))])
            step_loss += loss.item() / 2
        for param, (g0, g1) in zip(model.parameters(), zip(*grads, strict=True), strict=True):
            param.grad = (g0 + g1) / 2
        optimizer.step()
        losses.append(step_loss)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def trained() -> dict[str, Any]:
    return run_distributed(_variants, world_size=2)[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_single_process_reference(trained: dict[str, Any], variant: str) -> None:
    low = variant == "bf16"
    losses, params = reference(torch.bfloat16 if low else None)
    result = trained[variant]
    # bf16 differs from fp32 by ~1e-3 in the loss; from the bf16 emulation by ~1e-7 in the loss
    # and ~1e-4 in the parameters (bf16 rounding of gradients, reduced in another order).
    tolerance = {"rtol": 0.0, "atol": 3e-4} if low else {"rtol": 1e-5, "atol": 1e-6}
    assert result["param_types"] == ["DTensor"]
    assert result["blocks"] == BLOCKS.get(variant, [])
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=1e-5 if low else 1e-6
    )
    assert result["params"].keys() == params.keys()
    for key, value in params.items():
        torch.testing.assert_close(result["params"][key], value, **tolerance, msg=key)


def test_meta_init_equals_eager_init(trained: dict[str, Any]) -> None:
    eager = make_net(0).state_dict()
    for key, value in eager.items():
        torch.testing.assert_close(trained["meta"]["initial"][key], value, rtol=0, atol=0)


def test_ignored_params_of_another_builder_and_double_wrap() -> None:
    result = run_distributed(_ownership_and_errors, world_size=2)[0]
    assert result["out_type"] == "Parameter"
    kept_id, original_id = result["out_ids"]
    assert kept_id == original_id, "fsdp() replaced the parameter another builder owns"
    torch.testing.assert_close(result["out_after_fsdp"], result["out_before"], rtol=0, atol=0)
    assert result["out_owner"] == "other" and result["inp_owner"] == "fsdp"
    assert result["inp_type"] == "DTensor"
    assert result["old_replaced"] == "fsdp" and result["out_replaced"] is None
    assert "already set up by fsdp()" in result["twice"]
    assert "already sharded by an fsdp() call on an enclosing" in result["block_twice"]
    torch.testing.assert_close(result["meta_out_after"], result["meta_out_before"], rtol=0, atol=0)
    assert result["meta_left"] == []
    assert result["nested_blocks"] == ["blocks.1"]
    for key, value in reference()[1].items():
        torch.testing.assert_close(result["nested_params"][key], value, rtol=1e-5, atol=1e-6)


def test_checkpoint_reshards_to_one_plain_process_and_back_to_two(tmp_path: Path) -> None:
    saved = run_distributed(_save, world_size=2, args=(str(tmp_path),))[0]
    path = tmp_path / "fsdp"
    plain = make_net(5)
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.5)
    mp.ManualParallelStrategy().load_checkpoint(
        path, {"model": plain, "optim": optimizer, "step": 0}
    )
    one = {"params": plain.state_dict(), "optim": get_optimizer_state_dict(plain, optimizer)}
    two = run_distributed(_load, world_size=2, args=(str(path),))[0]
    assert two["step"] == STEPS
    for loaded in (one, two):
        for key, value in saved["params"].items():
            torch.testing.assert_close(loaded["params"][key], value, rtol=0, atol=0)
        for key, state in saved["optim"]["state"].items():
            for name in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(
                    loaded["optim"]["state"][key][name],
                    state[name],
                    rtol=0,
                    atol=0,
                    msg=f"{key} {name}",
                )
        assert loaded["optim"]["param_groups"][0]["lr"] == LR
