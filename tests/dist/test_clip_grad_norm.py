"""mp.clip_grad_norm_ on 2 ranks over ddp + fsdp + replicated DTensor gradients, against torch's
clip_grad_norm_ on one process over the global batch."""

from __future__ import annotations

import pytest
import torch
from clip_cases import mixed, reference

from manualpar.testing import run_distributed


@pytest.mark.parametrize(("max_norm", "norm_type"), [(0.05, 2.0), (0.01, float("inf")), (1e6, 2.0)])
def test_mixed_model_clips_by_the_global_norm(max_norm: float, norm_type: float) -> None:
    expected = reference(max_norm, norm_type)
    for result in run_distributed(mixed, world_size=2, args=(max_norm, norm_type)):
        assert result["total"] == pytest.approx(expected["total"], rel=1e-5)
        assert len(result["grads"]) == len(expected["grads"])
        for got, want in zip(result["grads"], expected["grads"], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
