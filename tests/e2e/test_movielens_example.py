"""The MovieLens example as a user runs it, on 2 ranks over a small ratings file: it trains with
early stopping and a best checkpoint, and its test metrics (sharded full ranking, metrics over
every rank's users) equal a plain-torch evaluation of that checkpoint on one process."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from example_modules import EXAMPLES, load_example
from launch import run_torchrun

import manualpar as mp

USERS, ITEMS = 40, 30


def _ratings_file(path: Path) -> Path:
    """u.data: each user rates 8-20 items, the next item often the one after the last, with
    repeated timestamps (ties kept in file order)."""
    generator = torch.Generator().manual_seed(0)
    lines = []
    for user in range(USERS):
        count = int(torch.randint(8, 21, (1,), generator=generator))
        item = int(torch.randint(ITEMS, (1,), generator=generator))
        for position in range(count):
            jump = int(torch.randint(ITEMS, (1,), generator=generator))
            item = (item + 1) % ITEMS if position % 3 else jump
            lines.append(f"{user + 1}\t{item + 1}\t4\t{1000 + position // 2}\n")
    path.write_text("".join(lines))
    return path


def _load_example() -> dict:
    protocol = load_example(Path("movielens/protocol.py"), "mle_protocol")
    model = load_example(Path("movielens/model.py"), "mle_model", {"protocol": protocol})
    return {"ratings": mp.data, "protocol": protocol, "model": model}


def test_trains_on_two_ranks_and_its_metrics_equal_a_plain_torch_evaluation(
    tmp_path: Path,
) -> None:
    path = _ratings_file(tmp_path / "u.data")
    run, result_file = tmp_path / "run", tmp_path / "result.json"
    out = run_torchrun(
        EXAMPLES / "movielens" / "train.py",
        *("--ratings", str(path), "--out", str(run), "--epochs", "6", "--patience", "2"),
        *("--batch", "16", "--eval-batch", "8", "--json", str(result_file), "--no-progress"),
        nproc=2,
        timeout=180,
        check=True,
    ).stdout
    result = json.loads(result_file.read_text())
    assert (result["users"], result["items"]) == (USERS, ITEMS)
    assert "sasrec" in out and "popularity" in out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if "val/ndcg@10" in r], records  # validated every epoch

    # the best checkpoint on one process, scored with plain torch against the whole table
    example = _load_example()
    protocol, model_module = example["protocol"], example["model"]
    split = protocol.leave_one_out(protocol.user_sequences(example["ratings"].read_ratings(path)))
    best = sorted(p for p in (run / "best").iterdir() if p.is_dir())
    assert len(best) == 1
    strategy = mp.ManualParallelStrategy()
    model = mp.load_trained(lambda: model_module.SASRec(ITEMS), strategy, best[0])
    model.eval()
    users = split.test
    histories = model_module.Histories(items=users.histories, target=users.targets)
    vectors = model.user_vectors(histories)
    with mp.full_tensors():
        table = model.items.state_dict()["tables.item.weight"].float()
    scores = vectors @ table.T
    target = scores.gather(1, users.targets[:, None])
    ids = torch.arange(ITEMS)
    ranks = (
        1 + (scores > target).sum(1) + ((scores == target) & (ids < users.targets[:, None])).sum(1)
    )
    for k in (10, 20):
        hit = (ranks <= k).double()
        expected = {
            f"hr@{k}": hit.mean().item(),
            f"ndcg@{k}": (hit / torch.log2(ranks.double() + 1)).mean().item(),
            f"mrr@{k}": (hit / ranks.double()).mean().item(),
        }
        for name, value in expected.items():
            assert result["sasrec"]["test"][name] == pytest.approx(value, abs=1e-9), name
    assert not math.isnan(result["popularity"]["test"]["ndcg@10"])
    strategy.teardown()
    del sys.modules["mle_model"]
