"""Trainer(precision=...): autocast around training_step and validation_step, fp32 parameters,
fp16's gradient scaler (checkpointed), and the refusal of fp16 with sharded tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_tables import tiny_tables
from torch import nn

import manualpar as mp


class Net(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.seen: dict[str, torch.dtype] = {}

    def training_step(self, batch: tuple, step: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x).squeeze(-1)
        self.seen["train"] = out.dtype
        return nn.functional.mse_loss(out.float(), y)

    def validation_step(self, batch: tuple) -> dict:
        x, y = batch
        out = self.net(x).squeeze(-1)
        self.seen["val"] = out.dtype
        return {"loss": nn.functional.mse_loss(out.float(), y)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def data(step: int, strategy: mp.ManualParallelStrategy) -> tuple:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(16, 6, generator=generator)
    return x, x.sum(-1).sin()


def losses(out: Path) -> list[float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if "loss" in r]


def fit(out: Path, precision: str, max_steps: int = 8, **kwargs: object) -> tuple[Net, dict]:
    torch.manual_seed(0)
    model = Net()
    trainer = mp.Trainer(
        mp.ManualParallelStrategy(), out, max_steps=max_steps, log_every=1, val_every=4,
        progress=False, precision=precision, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip
    return model, trainer.fit(model, data, val_data=data)


def test_bf16_mixed_autocasts_and_keeps_float32_parameters(tmp_path: Path) -> None:
    reference, _ = fit(tmp_path / "fp32", "32")
    model, last = fit(tmp_path / "bf16", "bf16-mixed")
    assert reference.seen == {"train": torch.float32, "val": torch.float32}
    assert model.seen == {"train": torch.bfloat16, "val": torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses(tmp_path / "bf16") == pytest.approx(losses(tmp_path / "fp32"), rel=0.03)
    assert losses(tmp_path / "bf16") != losses(tmp_path / "fp32")  # it did compute in bf16
    assert "grad_scale" not in last


def test_fp16_mixed_scales_the_loss_and_checkpoints_the_scaler(tmp_path: Path) -> None:
    model, _ = fit(tmp_path, "fp16-mixed", max_steps=4, clip_grad_norm=1.0)
    assert model.seen["train"] == torch.float16
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["grad_scale"] for r in records if "loss" in r] == [65536.0] * 4  # no overflow
    assert all(0 < r["grad_norm"] < 1e3 for r in records if "loss" in r)  # unscaled, then clipped
    latest = mp.latest_checkpoint(tmp_path / "checkpoints")
    assert mp.describe_checkpoint(latest)["entries"]["scaler"] == "stateful"
    restored = torch.amp.GradScaler("cpu", init_scale=2.0)
    mp.ManualParallelStrategy().load_checkpoint(latest, {"scaler": restored})
    assert restored.get_scale() == 65536.0
    assert losses(tmp_path) == pytest.approx(losses_of_fp32(tmp_path / "ref"), rel=0.01)


def losses_of_fp32(out: Path) -> list[float]:
    fit(out, "32", max_steps=4, clip_grad_norm=1.0)
    return losses(out)


class Tabled(Net):
    def __init__(self) -> None:
        super().__init__()
        self.emb = mp.EmbeddingBagCollection(tiny_tables())

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.emb = mp.shard_embeddings(self.emb, strategy, "auto", mp.embeddings.SGD(lr=0.1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=0.01)


def test_fp16_mixed_is_refused_with_sharded_tables(tmp_path: Path) -> None:
    trainer = mp.Trainer(mp.ManualParallelStrategy(), tmp_path, max_steps=1, precision="fp16-mixed")
    with pytest.raises(mp.ConfigError, match=r"Tabled holds sharded embedding tables \(emb\).*use "
                       r"precision='bf16-mixed'"):  # fmt: skip
        trainer.fit(Tabled(), data)


def test_an_unknown_precision_is_refused() -> None:
    with pytest.raises(
        mp.ConfigError, match=r"precision must be one of \('32', 'bf16-mixed', 'fp16"
    ):
        mp.Trainer(mp.ManualParallelStrategy(), "x", max_steps=1, precision="16")
