"""Rank functions for the Trainer tests: one rank's data running out, background saves."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

import manualpar as mp


class Regression(mp.ParallelModule):
    """A DDP model without dropout: every rank's weights follow from the batches alone."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.net = mp.ddp(self.net, strategy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=0.01)

    def training_step(self, batch: tuple, step: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)


class RankData:
    """Batches keyed by index; rank r has `counts[r]` of them, then raises StopIteration."""

    def __init__(self, counts: list[int] | None = None) -> None:
        self.counts = counts

    def __call__(self, index: int, strategy: mp.ManualParallelStrategy) -> tuple:
        if self.counts is not None and index >= self.counts[strategy.rank]:
            raise StopIteration
        generator = torch.Generator().manual_seed(index * 97 + strategy.rank)
        x = torch.randn(8, 6, generator=generator)
        return x, x.sum(-1).sin()


class NoneAt(RankData):
    """RankData, but the batch `index` of rank `rank` is None (not a batch)."""

    def __init__(self, rank: int, index: int) -> None:
        super().__init__()
        self.where = (rank, index)

    def __call__(self, index: int, strategy: mp.ManualParallelStrategy) -> tuple | None:
        if (strategy.rank, index) == self.where:
            return None
        return super().__call__(index, strategy)


def none_batch(out_dir: str, rank: int, index: int) -> dict:
    """Train towards 10 steps on data whose batch `index` on `rank` is None: where each rank
    stopped and what it raised."""
    strategy = mp.ManualParallelStrategy()
    model = Regression()
    trainer = mp.Trainer(strategy, out_dir, max_steps=10, log_every=2, progress=False)
    error = None
    try:
        trainer.fit(model, NoneAt(rank, index))
    except Exception as raised:
        error = f"{type(raised).__name__}: {raised}"
    del model  # DDP before the group
    strategy.teardown()
    return {"step": trainer.step, "error": error}


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train(
    strategy: mp.ManualParallelStrategy,
    out_dir: Path,
    max_steps: int,
    counts: list[int] | None,
    accumulate: int,
    asynchronous: bool,
) -> tuple[mp.Trainer, dict[str, torch.Tensor]]:
    strategy.seed_everything(0)
    model = Regression()
    trainer = mp.Trainer(
        strategy,
        out_dir,
        max_steps=max_steps,
        accumulate=accumulate,
        checkpoint_every=3,
        log_every=2,
        progress=False,
        async_checkpoint=asynchronous,
    )
    trainer.fit(model, RankData(counts))
    params = {k: v.detach().clone() for k, v in model.net.module.state_dict().items()}
    del model  # DDP before the group
    return trainer, params


def uneven_data(out_dir: str, counts: list[int], accumulate: int, asynchronous: bool) -> dict:
    """Train with `counts[r]` micro-batches on rank r (max_steps well beyond), then a reference
    run of exactly the steps the first one took, on data that never runs out."""
    captured = _Captured()
    logging.getLogger("manualpar").addHandler(captured)
    strategy = mp.ManualParallelStrategy()
    trainer, params = _train(
        strategy, Path(out_dir) / "uneven", 20, counts, accumulate, asynchronous
    )
    stopped = trainer.step
    _, reference = _train(strategy, Path(out_dir) / "reference", stopped, None, accumulate, False)
    checkpoints = Path(out_dir) / "uneven" / "checkpoints"
    metrics = (Path(out_dir) / "uneven" / "metrics.jsonl").read_text().splitlines()
    strategy.teardown()
    return {
        "step": stopped,
        "ran_out": trainer.data_ran_out,
        "messages": [m for m in captured.messages if "ran out" in m],
        "same_as_reference": all(torch.equal(params[k], reference[k]) for k in reference),
        "checkpoint_step": mp.read_manifest(mp.latest_checkpoint(checkpoints))["step"],
        "records": [json.loads(line) for line in metrics],
    }


class Validated(Regression):
    def validation_step(self, batch: tuple) -> dict:
        x, y = batch
        prediction = self.net(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(prediction, y), "bias": (prediction - y).mean()}


def uneven_val_data(out_dir: str, val_counts: list[int], val_steps: int) -> dict:
    """Train 4 steps validating every 2 on `val_counts[r]` batches on rank r; then recompute the
    last pass by hand over the batches every rank has (the common prefix)."""
    captured = _Captured()
    logging.getLogger("manualpar").addHandler(captured)
    strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(0)
    model = Validated()
    trainer = mp.Trainer(
        strategy, out_dir, max_steps=4, val_every=2, val_steps=val_steps, log_every=2,
        progress=False,
    )  # fmt: skip
    last = trainer.fit(model, RankData(), val_data=RankData(val_counts))
    common = min(val_counts)
    model.eval()
    with torch.no_grad():
        values = [model.validation_step(RankData()(i, strategy)) for i in range(common)]
    mine = torch.tensor(
        [sum(float(v["bias"]) for v in values) / common,
         sum(float(v["loss"]) for v in values) / common], dtype=torch.float64,
    )  # fmt: skip
    expected = strategy.all_reduce(mine, op="mean").tolist()
    metrics = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    del model  # DDP before the group
    strategy.teardown()
    return {
        "step": trainer.step,
        "last": last,
        "expected": {"val/bias": expected[0], "val/loss": expected[1]},
        "ran_out": trainer.val_data_ran_out,
        "messages": [m for m in captured.messages if "ran out" in m],
        "records": [json.loads(line) for line in metrics],
    }
