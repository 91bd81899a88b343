"""Trainer on real ranks: resume reproduces the uninterrupted run bit for bit (synchronous or
background saves), checkpoint cadence, metrics, the recorded loss is the mean over ranks, one
rank's data running out stops every rank at the same step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from trainer_cases import none_batch, uneven_data, uneven_val_data

import manualpar as mp
from manualpar.testing import run_distributed


class Regression(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1))

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.net = mp.ddp(self.net, strategy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=0.01)

    def training_step(self, batch: tuple, step: int) -> dict:
        if os.environ.get("CRASH_AT_STEP") == str(step):
            raise RuntimeError(f"injected crash at step {step}")
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        return {"loss": loss, "abs_error": (self.net(x).squeeze(-1) - y).abs().mean()}

    def validation_step(self, batch: tuple) -> dict:
        x, y = batch
        return {"loss": nn.functional.mse_loss(self.net(x).squeeze(-1), y)}


def data(step: int, strategy: mp.ManualParallelStrategy) -> tuple:
    generator = torch.Generator().manual_seed(step * 97 + strategy.rank)
    x = torch.randn(8, 6, generator=generator)
    return x, x.sum(-1).sin()


def _fit(
    out_dir: str, max_steps: int, crash_at: int | None = None, asynchronous: bool = False
) -> dict:
    if crash_at is not None:
        os.environ["CRASH_AT_STEP"] = str(crash_at)
    strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(0)
    model = Regression()
    trainer = mp.Trainer(
        strategy,
        out_dir,
        max_steps=max_steps,
        checkpoint_every=4,
        keep_last=2,
        log_every=1,
        val_every=5,
        val_steps=2,
        progress=False,
        async_checkpoint=asynchronous,
    )
    last = trainer.fit(model, data, val_data=data)
    params = {k: v.detach().clone() for k, v in model.net.module.state_dict().items()}
    # DDP must go before its process group: freeing it after teardown can hang in gloo
    del trainer, model
    strategy.teardown()
    return {"params": params, "last": last}


def _losses(out_dir: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_resumed_run_equals_uninterrupted_run(tmp_path: Path, asynchronous: bool) -> None:
    straight = run_distributed(_fit, world_size=2, args=(str(tmp_path / "a"), 10))
    crashed = run_distributed(
        _fit, world_size=2, args=(str(tmp_path / "b"), 10, 7, asynchronous), allow_failure=True
    )
    assert any(o.error and "injected crash at step 7" in o.error for o in crashed)
    assert mp.read_manifest(mp.latest_checkpoint(tmp_path / "b" / "checkpoints"))["step"] == 4
    # the crashed run's background save of step 4 committed before fit() re-raised
    resumed = run_distributed(
        _fit, world_size=2, args=(str(tmp_path / "b"), 10, None, asynchronous)
    )
    for rank in range(2):
        for key, value in straight[rank]["params"].items():
            assert torch.equal(value, resumed[rank]["params"][key]), key
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")  # every step, same float
    assert sorted(_losses(tmp_path / "b")) == list(range(1, 11))


def test_checkpoint_cadence_and_metrics_file(tmp_path: Path) -> None:
    run_distributed(_fit, world_size=2, args=(str(tmp_path), 10))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000008", "step_00000010"]  # every 4 + the end, keep_last=2
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val/loss" in r]
    assert [r["step"] for r in train] == list(range(1, 11))
    assert set(train[0]) == {"step", "loss", "abs_error", "lr", "steps_per_s"}
    assert [r["step"] for r in val] == [5, 10]
    assert all(r["lr"] == 0.01 for r in train)


def test_an_unreadable_latest_checkpoint_is_skipped_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's object file of the latest checkpoint is cut: only rank 1 reads it, yet both
    ranks skip that checkpoint for the one before it, together, and say so once."""
    run_distributed(_fit, world_size=2, args=(str(tmp_path), 8))
    latest = tmp_path / "checkpoints" / "step_00000008"
    rank_file = latest / "objects" / "rank_1.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-10])
    run_distributed(_fit, world_size=2, args=(str(tmp_path), 10))
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (event,) = [r for r in records if r.get("event") == "checkpoint_skipped"]
    assert event["step"] == 4 and event["checkpoint"] == str(latest)
    assert event["resumed_from"] == str(tmp_path / "checkpoints" / "step_00000004")
    assert f"failed on rank 1: {rank_file} is corrupted or truncated" in event["reason"]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 11))  # 5-8 redone


def _loss_of(step: int) -> float:
    """The mean over both ranks' batches of step `step`, computed by hand (untrained model)."""
    strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(0)
    model = Regression()
    model.setup(strategy)
    model.eval()
    value = model.training_step(data(step, strategy), step)["loss"].item()
    return strategy.all_reduce(torch.tensor(value, dtype=torch.float64)).item()


def test_recorded_loss_is_the_mean_over_ranks(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(0)
    model = Regression()
    model.net[2].p = 0.0  # no dropout: the first step's loss is deterministic
    trainer = mp.Trainer(strategy, tmp_path, max_steps=1, log_every=1, progress=False)
    trainer.fit(model, data)
    recorded = _losses(tmp_path)[1]
    expected = run_distributed(_loss_of, world_size=1, args=(0,))[0]
    assert recorded == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("counts", "accumulate", "asynchronous", "stop", "message"),
    [
        ([100, 5], 1, False, 5, "rank 1 (batch 5) at step 5"),
        # 7 micro-batches on rank 2: step 3 would need batches 6 and 7, so it is dropped whole
        ([100, 100, 7], 2, True, 3, "rank 2 (batch 7) at step 3"),
    ],
    ids=["2_ranks", "3_ranks_accumulate_async"],
)
def test_data_running_out_on_one_rank_stops_every_rank_at_the_same_step(
    tmp_path: Path,
    counts: list[int],
    accumulate: int,
    asynchronous: bool,
    stop: int,
    message: str,
) -> None:
    results = run_distributed(
        uneven_data,
        world_size=len(counts),
        args=(str(tmp_path), counts, accumulate, asynchronous),
        collective_timeout=30,  # a hang would fail with the timeout, far slower than the run
    )
    short = len(counts) - 1
    for result in results:
        assert result["step"] == stop and result["checkpoint_step"] == stop
        assert result["ran_out"] == {short: counts[short]}
        assert len(result["messages"]) == 1 and message in result["messages"][0]
        assert f"every rank stops at step {stop} (of max_steps=20)" in result["messages"][0]
        assert result["same_as_reference"]  # weights of a run of exactly `stop` steps
    records = results[0]["records"]
    assert records[-1] == {"step": stop, "event": "data_ran_out", "ranks": [short]}
    assert [r["step"] for r in records if "loss" in r][-1] == stop  # the last window recorded


def test_a_batch_of_none_on_one_rank_raises_on_every_rank_at_the_same_step(
    tmp_path: Path,
) -> None:
    """None is not a batch: rank 1's batch 3 is refused at step 3 on both ranks, naming rank 1,
    instead of failing rank 1's training_step while rank 0 waits in DDP's all-reduce."""
    results = run_distributed(
        none_batch, args=(str(tmp_path), 1, 3), collective_timeout=20, timeout=60
    )
    for result in results:
        assert result == {
            "step": 3,
            "error": "DataError: data returned None for batch 3 on rank 1; every rank raises "
            "this at the same step. A batch must not be None, which means 'no batch' to the "
            "loop: return the batch, or raise StopIteration when this rank's data has ended "
            "(every rank then stops there)",
        }


def test_validation_data_running_out_on_one_rank_ends_every_rank_at_the_same_batch(
    tmp_path: Path,
) -> None:
    """Rank 1 has 3 of the 5 validation batches: both passes (steps 2 and 4) end after batch 2
    on every rank, with means over those 3 batches; logged once, on rank 0."""
    results = run_distributed(
        uneven_val_data,
        args=(str(tmp_path), [5, 3], 5),
        collective_timeout=30,  # a hang would fail with the timeout, far slower than the run
    )
    for result in results:
        assert result["step"] == 4  # training is not affected
        assert result["ran_out"] == {1: 3}
        for name, value in result["expected"].items():
            assert result["last"][name] == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert results[0]["messages"] == [
        "validation data ran out on rank 1 (batch 3) at step 2; every rank ends each validation "
        "pass after 3 of val_steps=5 batches, and the val/ metrics are means over those"
    ]
    assert results[1]["messages"] == []
    records = results[0]["records"]
    assert {"step": 2, "event": "val_data_ran_out", "ranks": [1], "batches": 3} in records
    assert [r["step"] for r in records if "val/loss" in r] == [2, 4]
