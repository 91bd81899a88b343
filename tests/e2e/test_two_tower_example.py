"""The two-tower example as a user runs it on 2 ranks: it learns (in-batch negatives gathered
over ranks, clipping, schedules for both optimizers), then a fine-tune with the tables frozen
changes the MLPs and leaves every table row as it was."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy
import pytest
import torch
from example_modules import EXAMPLES, load_example
from launch import run_torchrun

import manualpar as mp
from manualpar.embeddings import SparseFeatures

SMALL = ("--users", "2000", "--items", "512", "--clusters", "8", "--batch", "128")
SMALL += ("--no-progress", "--log-every", "10", "--val-every", "20", "--seed", "0")


def _train(*args: str) -> str:
    script = EXAMPLES / "two_tower" / "train.py"
    return run_torchrun(script, *SMALL, *args, nproc=2, timeout=150, check=True).stdout


def _hit_rates(out: str) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(r"(before|after): .* hit rate (\d\.\d+)", out)}


def _load(run: Path, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """The run's latest checkpoint in the example's model, on this one process."""
    monkeypatch.setitem(sys.modules, "data", load_example(Path("two_tower/data.py"), "tt_data"))
    model = load_example(Path("two_tower/model.py"), "tt_model")
    strategy = mp.ManualParallelStrategy()
    sizes = {"users": 2000, "items": 512, "clusters": 8}
    checkpoint = mp.latest_checkpoint(run / "checkpoints")
    assert checkpoint is not None
    return mp.load_trained(lambda: model.TwoTower(**sizes), strategy, checkpoint)


def test_trains_then_fine_tunes_with_frozen_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pretrain, finetune = tmp_path / "pretrain", tmp_path / "finetune"
    out = _train("--out", str(pretrain), "--steps", "60")
    hits = _hit_rates(out)
    assert hits["before"] < 0.3 and hits["after"] > 0.8, out  # chance: 1/8
    records = [json.loads(line) for line in (pretrain / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert all(r["grad_norm"] > 0 for r in train)  # clipping ran and logged the norm
    for key in ("lr", "sparse_optim_user_tables/lr", "sparse_optim_item_tables/lr"):
        rates = [r[key] for r in train]
        assert rates == sorted(rates, reverse=True) and rates[-1] < 0.1 * rates[0], key

    precision = float(re.search(r"precision@10 (\d\.\d+) of the user's cluster", out)[1])
    assert precision > 0.9, out  # chance: 1/8

    out = _train("--out", str(finetune), "--steps", "20", "--finetune-from", str(pretrain))
    assert "fine-tuning from" in out and "with the tables frozen" in out
    before, after = _load(pretrain, monkeypatch), _load(finetune, monkeypatch)
    tables = [n for n, _ in before.named_parameters() if "_tables." in n]
    assert len(tables) == 4
    mlps = [n for n, _ in before.named_parameters() if "_mlp." in n]
    theirs = dict(after.named_parameters())
    for name, param in before.named_parameters():
        if name in tables:
            assert torch.equal(param, theirs[name]), f"frozen table {name} changed"
    assert any(not torch.equal(dict(before.named_parameters())[n], theirs[n]) for n in mlps)

    # the retrieval the run printed, redone with plain torch on one process: every item's
    # vector, each validation user's 10 best by score (ties: smaller id), their clusters
    data = sys.modules["data"].RetrievalData(2000, 512, 8, 128, seed=0)
    strategy = mp.ManualParallelStrategy()
    pairs = data.validation(0, strategy)
    with torch.no_grad():
        every = torch.arange(512)
        items = SparseFeatures(
            ("item_id", "item_category"),
            torch.cat([every, every % 8]),
            torch.ones(1024, dtype=torch.int64),
        )
        scores = (
            before.embed_users(pairs).double() @ before.item_vectors(items).double().T
        ).float()
    order = torch.from_numpy(
        numpy.lexsort((every.numpy()[None].repeat(len(scores), 0), -scores.numpy()))
    )
    best = order[:, :10]
    segments = pairs.users["user_segment"].values
    assert (best % 8 == segments[:, None]).double().mean().item() == pytest.approx(
        precision, abs=5e-4
    )
