"""`python -m manualpar plan --bags-per-feature FEATURE=BAGS`: a batch per feature, priced as
the planner prices PlanOptions(bags_per_feature=), its bytes line equal to the bytes a step of
such batches sends (exchange_bytes), a replicated plan's sizes counted with it too, and a
malformed value refused in one line naming the feature."""

from __future__ import annotations

from pathlib import Path

import pytest

from manualpar.cli import main
from manualpar.embeddings import EmbeddingBagConfig, EmbeddingPlan, SparseFeatures
from manualpar.embeddings.planning import (
    exchange_bytes,
    format_bytes,
    per_rank_text,
    plan_tables,
)

TABLES = ["--table", "user:100000:16", "--table", "item:100000:16:item,last_item"]
CONFIGS = [
    EmbeddingBagConfig("user", 100_000, 16),
    EmbeddingBagConfig("item", 100_000, 16, feature_names=("item", "last_item")),
]
BATCH = 64


def _bytes_line(capsys: pytest.CaptureFixture, *args: str) -> str:
    assert main(["plan", *TABLES, "--world-size", "2", "--batch-per-rank", str(BATCH), *args]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "bytes sent per rank" in x]
    return line


def _batch(rank: int, user_bags: int) -> SparseFeatures:
    """One id a bag; "user" holds `user_bags` bags that the 64 samples read in turn."""
    ids = [[(rank * 7 + b * 13) % 1000] for b in range(BATCH)]
    bags = {"user": ids[:user_bags], "item": ids, "last_item": ids}
    return SparseFeatures.from_dict(bags, None, {"user": [b % user_bags for b in range(BATCH)]})


def test_the_bytes_line_prices_a_batch_per_feature_as_a_step_sends_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "plan.json"
    full = _bytes_line(capsys, "--plan", "table_wise")
    line = _bytes_line(capsys, "--plan", "table_wise", "--bags-per-feature", "user=8")
    assert line.startswith(
        f"  bytes sent per rank and step ({BATCH} samples, 1 ids per bag, user 8 bags): "
    )
    assert line != full.replace("per bag)", "per bag, user 8 bags)")
    plan = EmbeddingPlan.from_json(
        (_bytes_line(capsys, "--plan", "table_wise", "--json", str(out)), out.read_text())[1]
    )
    sent = exchange_bytes(CONFIGS, plan, [_batch(0, 8), _batch(1, 8)])
    assert line.endswith(per_rank_text([int(sent.sent(r)) for r in range(2)], format_bytes))


def test_the_planner_gets_the_bags_and_a_full_batch_named_so_is_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "plan.json"
    _bytes_line(capsys, "--bags-per-feature", "user=8,last_item=2", "--json", str(out))
    want = plan_tables(
        CONFIGS, 2, batch_per_rank=BATCH, pooling_factors={"user": 1.0, "item": 1.0},
        bags_per_feature={"user": 8, "last_item": 2},
    )  # fmt: skip
    assert EmbeddingPlan.from_json(out.read_text()) == want
    named = [f"--bags-per-feature={f}={BATCH}" for f in ("user", "item", "last_item")]
    full = _bytes_line(capsys).split("): ")[1]
    assert _bytes_line(capsys, *named).split("): ")[1] == full


def test_a_replicated_plan_sends_its_sizes_with_the_flag_too(
    capsys: pytest.CaptureFixture,
) -> None:
    """One source for the line (expected_sent_bytes): every table replicated, a step still
    sends its 4 int64 sizes to the other rank, a batch per feature's too."""
    full = _bytes_line(capsys, "--plan", "data_parallel")
    own = _bytes_line(capsys, "--plan", "data_parallel", "--bags-per-feature", "user=8")
    assert full.endswith("): r0: 32 bytes, r1: 32 bytes")
    assert own.split("): ")[1] == full.split("): ")[1]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("user=abc", "--bags-per-feature 'user=abc': feature 'user' needs a number of bags "
         "from 0 to the batch per rank (64), got 'abc'"),
        ("user=-1", "feature 'user' needs a number of bags from 0 to the batch per rank (64)"),
        ("user=nan", "feature 'user' needs a number of bags"),
        ("last_item=65", "feature 'last_item' needs a number of bags from 0 to the batch"),
        ("user", "--bags-per-feature 'user': expected FEATURE=BAGS"),
        ("=4", "--bags-per-feature '=4': expected FEATURE=BAGS"),
        ("ads=4", "no table has feature 'ads'; the features are user, item, last_item"),
        ("user=4,user=5", "--bags-per-feature: feature 'user' is given twice"),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_line_naming_the_feature(
    capsys: pytest.CaptureFixture, value: str, message: str
) -> None:
    args = [*TABLES, "--world-size", "2", "--batch-per-rank", str(BATCH)]
    assert main(["plan", *args, "--bags-per-feature", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
