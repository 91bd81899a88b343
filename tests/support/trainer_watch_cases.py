"""Models and rank functions for the Trainer's validation conveniences: early stopping and best
checkpoints driven by a fixed score schedule, metric objects over uneven ranks, validate()."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import manualpar as mp

# the mean over ranks of val/score at validation pass k (every 2 steps: step 2k + 2); "max" is
# better: improvements at passes 0, 1, 3 (0.6, step 8), then none -> patience 3 ends at step 14
SCORES = [0.1, 0.5, 0.4, 0.6, 0.55, 0.58, 0.59] + [0.2] * 20
# added on rank 0, taken from rank 1: the mean is SCORES, but rank 0 alone would see 0.75 at
# pass 4 (an improvement) and rank 1 0.2 at pass 1 (none): local decisions would differ
SKEW = {1: 0.3, 4: 0.2}
STOP_STEP = 14  # pass 6: the third without an improvement on 0.6


def rows(step: int, strategy: Any, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 97 + strategy.rank)
    x = torch.randn(n, 6, generator=generator)
    return x, x.sum(-1).sin()


class Scored(mp.ParallelModule):
    """A DDP regression whose val/score follows SCORES; `passes` (a buffer: checkpointed)
    counts validation passes (val_steps=1)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.register_buffer("passes", torch.zeros((), dtype=torch.long))

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.net = mp.ddp(self.net, strategy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=0.01)

    def training_step(self, batch: tuple, step: int) -> torch.Tensor:
        if os.environ.get("CRASH_AT_STEP") == str(step):
            raise RuntimeError(f"injected crash at step {step}")
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def validation_step(self, batch: tuple) -> dict:
        assert self.strategy is not None
        k = int(self.passes)
        self.passes += 1
        sign = 1 if self.strategy.rank == 0 else -1
        score = SCORES[k] + sign * SKEW.get(k, 0.0)
        x, y = batch
        return {"score": score, "loss": nn.functional.mse_loss(self.net(x).squeeze(-1), y)}


def records(out_dir: str | Path) -> list[dict]:
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def early_stopping_run(out_dir: str, crash_at: int | None = None, keep: int = 2) -> dict:
    """Train towards 40 steps with early stopping (patience 3) and the `keep` best checkpoints
    on val/score; then load each best checkpoint into a fresh model."""
    if crash_at is not None:
        os.environ["CRASH_AT_STEP"] = str(crash_at)
    strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(0)
    model = Scored()
    trainer = mp.Trainer(
        strategy, out_dir, max_steps=40, checkpoint_every=4, keep_last=10, log_every=3,
        val_every=2, progress=False,
        early_stopping=mp.EarlyStopping("val/score", mode="max", patience=3),
        best_checkpoints=mp.BestCheckpoints("val/score", mode="max", keep=keep),
    )  # fmt: skip
    trainer.fit(model, rows, val_data=rows)
    loaded = {}
    for path in sorted((Path(out_dir) / "best").glob("step_*")):
        fresh = Scored()
        fresh.setup(strategy)
        strategy.load_checkpoint(path, {"model": fresh})
        rolling = Scored()
        rolling.setup(strategy)
        strategy.load_checkpoint(Path(out_dir) / "checkpoints" / path.name, {"model": rolling})
        same = all(
            torch.equal(a, b)
            for a, b in zip(fresh.state_dict().values(), rolling.state_dict().values(), strict=True)
        )
        loaded[path.name] = {"passes": int(fresh.passes), "same_as_rolling": same}
        del fresh, rolling
    result = {
        "step": trainer.step,
        "stopped_early": trainer.stopped_early,
        "best_checkpoint": getattr(trainer.best_checkpoint, "name", None),
        "best_score": trainer.best_score,
        "wait": trainer.early_stopping.wait if trainer.early_stopping else None,
        "loaded": loaded,
        "latest": mp.read_manifest(mp.latest_checkpoint(Path(out_dir) / "checkpoints"))["step"],
    }
    del model, trainer
    strategy.teardown()
    return result


class SampleMean:
    """A metric object: the mean of |y| over every rank's samples, and their count (sums
    all-reduced in compute)."""

    def __init__(self) -> None:
        self.resets = 0
        self.reset()

    def reset(self) -> None:
        self.total, self.count = 0.0, 0
        self.resets += 1

    def update(self, values: torch.Tensor) -> None:
        self.total += float(values.abs().sum())
        self.count += values.numel()

    def compute(self, strategy: mp.ManualParallelStrategy) -> dict[str, float]:
        sums = torch.tensor([self.total, float(self.count)], dtype=torch.float64)
        sums = strategy.all_reduce(sums, op="sum")
        return {"abs_y": float(sums[0] / sums[1]), "samples": float(sums[1])}


class Measured(Scored):
    def __init__(self) -> None:
        super().__init__()
        self.metric = SampleMean()

    def validation_step(self, batch: tuple) -> dict:
        _, y = batch
        self.metric.update(y)
        return {"abs_y_mean": y.abs().mean(), "sample_mean": self.metric}


def uneven_rows(index: int, strategy: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Validation batches of 3 rows on rank 0, 5 on rank 1."""
    return rows(1000 + index, strategy, n=3 if strategy.rank == 0 else 5)


def metric_objects_run(out_dir: str) -> dict:
    """Validate twice during fit on uneven batches (3 rows on rank 0, 5 on rank 1, 2 batches),
    then validate() the best checkpoint; return what was recorded and the exact values."""
    strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(0)
    model = Measured()
    trainer = mp.Trainer(
        strategy, out_dir, max_steps=4, val_every=2, val_steps=2, log_every=2, progress=False,
        best_checkpoints=mp.BestCheckpoints("val/abs_y", mode="min"),
    )  # fmt: skip
    last = trainer.fit(model, rows, val_data=uneven_rows)
    ys = torch.cat([uneven_rows(i, strategy)[1] for i in range(2)])
    gathered = strategy.all_gather_object(ys.tolist())
    every = torch.tensor([v for rank in gathered for v in rank], dtype=torch.float64)
    mine = torch.tensor([float(uneven_rows(i, strategy)[1].abs().mean()) for i in range(2)])
    validated = trainer.validate(model, uneven_rows, checkpoint="best")
    result = {
        "last": last,
        "validated": validated,
        "best_checkpoint": getattr(trainer.best_checkpoint, "name", None),
        "resets": model.metric.resets,
        "exact": float(every.abs().mean()),
        "samples": every.numel(),
        "mean_of_means": float(strategy.all_reduce(mine.mean().double(), op="mean")),
        "records": records(out_dir) if strategy.is_global_zero else [],
    }
    del model, trainer
    strategy.teardown()
    return result
