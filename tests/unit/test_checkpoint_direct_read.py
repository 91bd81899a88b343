"""A load reads each plain saved tensor straight into the state (one read of its bytes, no
temporary tensor) and the others (small, saved with other strides) through DCP's reader; both
give the saved values bit for bit, and a file cut during the read is still named."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import manualpar as mp
import manualpar.checkpoint.direct as direct
import manualpar.checkpoint.load as loading


class _Mixed(nn.Module):
    """Tensors of each kind a load meets: large float32, bfloat16 and int64 ones and rows
    beside other values in memory, as a disk table's rows beside their optimizer state (read
    straight), one saved transposed, a small one and a scalar (read through DCP)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.big = nn.Parameter(torch.randn(256, 128, generator=generator))
        self.bfloat = nn.Parameter(torch.randn(256, 256, generator=generator).to(torch.bfloat16))
        self.register_buffer("counts", torch.randint(0, 1 << 40, (128, 128), generator=generator))
        self.register_buffer("rows", torch.randn(256, 130, generator=generator)[:, :128])
        self.turned = nn.Parameter(torch.randn(128, 256, generator=generator).t())
        self.small = nn.Parameter(torch.randn(4, generator=generator))
        self.register_buffer("scale", torch.tensor(3.0 + seed))


def _full_loads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Records each torch.load of a saved tensor's data (a stream, not a meta-only load)."""
    calls: list[Any] = []
    real = torch.load

    def spy(source: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(source, str | os.PathLike) and kwargs.get("map_location") != "meta":
            calls.append(source)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return calls


def test_plain_tensors_are_read_straight_into_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    strategy = mp.ManualParallelStrategy()
    saved = _Mixed(seed=0)
    strategy.save_checkpoint(tmp_path / "c", {"model": saved})
    model = _Mixed(seed=1)
    targets = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    beside = model.rows.as_strided((256, 2), (130, 1), 128).clone()
    calls = _full_loads(monkeypatch)
    monkeypatch.setattr(direct, "_BLOCK_BYTES", 4096)  # the strided rows in several blocks
    strategy.load_checkpoint(tmp_path / "c", {"model": model})
    for name, tensor in saved.state_dict().items():
        loaded = model.state_dict()[name]
        assert loaded.dtype == tensor.dtype, name
        assert torch.equal(loaded, tensor), name
        assert loaded.data_ptr() == targets[name], name  # loaded in place
    assert torch.equal(model.rows.as_strided((256, 2), (130, 1), 128), beside)  # untouched
    assert len(calls) == 3  # turned, small and scale; the others read straight


def test_a_large_tensor_cut_during_the_read_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    strategy = mp.ManualParallelStrategy()
    strategy.save_checkpoint(tmp_path / "c", {"model": _Mixed(seed=0)})
    file = tmp_path / "c" / "__0_0.distcp"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])  # as if cut after the check
    monkeypatch.setattr(loading, "check_tensor_files", lambda *args: None)
    with pytest.raises(mp.CheckpointError) as caught:
        strategy.load_checkpoint(tmp_path / "c", {"model": _Mixed(seed=1)})
    assert re.search(
        r"reading tensor shards failed on rank 0: __0_0\.distcp \(bytes \d+-\d+\): EOFError "
        r"\(no message\)\. The files passed the check before this read",
        str(caught.value),
    ), str(caught.value)
