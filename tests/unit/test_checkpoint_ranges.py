"""Loading values into a narrower dtype (float32 into float16): values beyond its finite range
are refused, naming the tensor and how many, before anything is modified; saturate=True clamps
them; values in range still load (rounded to nearest)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import manualpar as mp


def _saved_linear(path: Path, *, large: bool, full: bool) -> torch.Tensor:
    """Save an fp32 Linear(16, 32) whose first 260 of 512 weights are 1e5 (or 6e4: in range)."""
    model = nn.Linear(16, 32)
    with torch.no_grad():
        flat = model.weight.view(-1)
        flat[:260] = 1e5 if large else 6e4
        flat[260:] = torch.linspace(-1.0, 1.0, 252)
    mp.ManualParallelStrategy().save_checkpoint(path, {"model": model}, full=full)
    return model.weight.detach().clone()


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_values_beyond_float16_are_refused_in_range_values_load(tmp_path: Path, full: bool) -> None:
    strategy = mp.ManualParallelStrategy()
    path = tmp_path / ("big.pt" if full else "big")
    _saved_linear(path, large=True, full=full)
    target = nn.Linear(16, 32).half()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(mp.CheckpointError) as caught:
        strategy.load_checkpoint(path, {"model": target})
    assert str(caught.value) == (
        f"load_checkpoint({path}) on rank 0: model/weight (saved as float32): 260 of 512 "
        "values are beyond float16's finite range (+-65504; the largest is 100000). They "
        "would load as inf. Load them into a wider dtype (float32, or bfloat16, whose range "
        "is float32's), rescale them, or pass saturate=True to clamp them to the largest "
        "finite value; nothing was loaded"
    )
    for key, value in target.state_dict().items():  # neither the weight nor the bias changed
        assert torch.equal(value, before[key]), key

    in_range = tmp_path / ("ok.pt" if full else "ok")
    source = _saved_linear(in_range, large=False, full=full)
    strategy.load_checkpoint(in_range, {"model": target})
    assert torch.equal(target.weight, source.half())
    assert torch.isfinite(target.weight).all()


def test_saturate_clamps_to_the_largest_finite_value_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _saved_linear(tmp_path / "big", large=True, full=False)
    target = nn.Linear(16, 32).half()
    with caplog.at_level(logging.WARNING, logger="manualpar.checkpoint"):
        mp.ManualParallelStrategy().load_checkpoint(
            tmp_path / "big", {"model": target}, saturate=True
        )
    assert torch.equal(target.weight, source.clamp(-65504, 65504).half())
    assert f"model/weight: 260 of 512 values saved as float32 in {tmp_path / 'big'} are " in (
        caplog.text
    )
    assert "clamped to +-65504 (saturate=True)" in caplog.text
