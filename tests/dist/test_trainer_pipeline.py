"""The Trainer pipelines a model that defines `prefetch(batch)`: the next step's batch is fetched
and its ids sent before each step. The numbers equal the unpipelined Trainer's bit for bit, also
when one rank's data runs out with a batch in flight and across a resume (and with step times
recorded: timing changes no number)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.loop.step_times import PHASES
from manualpar.testing import run_distributed


class Model(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = EmbeddingBagCollection(
            [EmbeddingBagConfig("user", 50, 4), EmbeddingBagConfig("item", 20, 4)], seed=3
        )
        self.head = torch.nn.Linear(8, 1)
        self.prefetched = 0

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        plan = {"user": row_wise(), "item": table_wise(strategy.world_size - 1)}
        self.sparse = shard_embeddings(self.sparse, strategy, plan, RowWiseAdagrad(lr=0.05))
        mp.materialize(self, strategy, seed=0)
        self.head = mp.ddp(self.head, strategy)

    def prefetch(self, batch: tuple[SparseFeatures, torch.Tensor]) -> None:
        self.prefetched += 1
        self.sparse.prefetch(batch[0])

    def training_step(self, batch: tuple[SparseFeatures, torch.Tensor], step: int) -> torch.Tensor:
        features, labels = batch
        logits = self.head(self.sparse(features).values).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=0.01)


def _data(ends_at: dict[int, int]):  # type: ignore[no-untyped-def]
    def data(
        index: int, strategy: mp.ManualParallelStrategy
    ) -> tuple[SparseFeatures, torch.Tensor]:
        if index >= ends_at.get(strategy.rank, 10**9):
            raise StopIteration
        g = torch.Generator().manual_seed(1000 * index + strategy.rank)
        size = 3 + strategy.rank
        features = SparseFeatures.from_dict(
            {
                "user": [torch.randint(0, 50, (2,), generator=g).tolist() for _ in range(size)],
                "item": [torch.randint(0, 20, (1,), generator=g).tolist() for _ in range(size)],
            }
        )
        return features, torch.randint(0, 2, (size,), generator=g).float()

    return data


def _fit(
    out: str, pipeline: bool, max_steps: int, ends_at: dict[int, int], times: int | None = None
) -> dict:
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        model = Model()
    trainer = mp.Trainer(
        strategy, out, max_steps=max_steps, checkpoint_every=3, log_every=1, progress=False,
        pipeline=pipeline, step_times_every=times,
    )  # fmt: skip
    trainer.fit(model, _data(ends_at))
    with mp.full_tensors():
        state = {k: v.clone() for k, v in model.state_dict().items()}
    result = {"state": state, "step": trainer.step, "prefetched": model.prefetched}
    strategy.teardown()
    return result


def _losses(out: Path) -> list[float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.timeout(120)
def test_the_pipelined_trainer_equals_the_plain_one_and_resumes(tmp_path: Path) -> None:
    plain = run_distributed(_fit, 2, args=(str(tmp_path / "plain"), False, 7, {}), timeout=60)
    piped = run_distributed(_fit, 2, args=(str(tmp_path / "piped"), True, 4, {}, 2), timeout=60)
    assert [r["prefetched"] for r in piped] == [3, 3]  # steps 1..3 were sent ahead
    resumed = run_distributed(_fit, 2, args=(str(tmp_path / "piped"), True, 7, {}, 2), timeout=60)
    assert [r["prefetched"] for r in resumed] == [2, 2]  # steps 5, 6 (4 began the resumed run)
    assert [r["prefetched"] for r in plain] == [0, 0]
    assert _losses(tmp_path / "piped") == _losses(tmp_path / "plain")
    _check_step_times(tmp_path / "piped", [2, 4, 6])
    for rank in range(2):
        for key, value in plain[rank]["state"].items():
            assert torch.equal(resumed[rank]["state"][key], value), key


def _check_step_times(out: Path, steps: list[int]) -> None:
    """Records of the timed steps, slowest rank's and mean seconds per phase (means add up)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    timed = [r for r in map(json.loads, lines) if "time/step" in r]
    assert [r["step"] for r in timed] == steps
    names = [*PHASES, "step"]
    for record in timed:
        assert set(record) == {"step", *(f"time{k}/{n}" for k in ("", "_mean") for n in names)}
        means = [record[f"time_mean/{name}"] for name in PHASES]
        assert min(means) >= 0 and sum(means) <= record["time_mean/step"] * (1 + 1e-9), record
        assert all(record[f"time/{n}"] >= record[f"time_mean/{n}"] for n in names), record


@pytest.mark.timeout(120)
def test_data_running_out_with_a_batch_in_flight_stops_every_rank_at_the_same_step(
    tmp_path: Path,
) -> None:
    ends = {1: 4}  # rank 1 has batches 0..3: step 4 is never taken, on any rank
    plain = run_distributed(_fit, 2, args=(str(tmp_path / "plain"), False, 9, ends), timeout=60)
    piped = run_distributed(_fit, 2, args=(str(tmp_path / "piped"), True, 9, ends), timeout=60)
    for rank in range(2):
        assert plain[rank]["step"] == piped[rank]["step"] == 4
        for key, value in plain[rank]["state"].items():
            assert torch.equal(piped[rank]["state"][key], value), key
