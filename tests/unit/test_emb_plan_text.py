"""A plan stays readable at any world size: up to 8 ranks every block and rank is listed (as
before); past that, runs of equal blocks become ranges and per-rank bytes a summary."""

from __future__ import annotations

import pytest

from manualpar.cli import main
from manualpar.embeddings import (
    EmbeddingBagConfig,
    EmbeddingPlan,
    data_parallel,
    row_wise,
    table_wise,
)
from manualpar.embeddings.plan import Shard
from manualpar.embeddings.plan_text import per_rank_text, shards_text


def test_a_plan_on_1024_ranks_prints_ranges_and_a_summary() -> None:
    configs = [
        EmbeddingBagConfig("tiny", 128, 16),
        EmbeddingBagConfig("users", 10_240_000, 64),
        EmbeddingBagConfig("ads", 50_000, 32),
    ]
    plan = EmbeddingPlan(1024, {"tiny": data_parallel(), "users": row_wise(), "ads": table_wise(7)})
    lines = plan.describe(configs).splitlines()
    assert lines[1].endswith("r0-r1023: rows[0:128] each")
    assert lines[2].endswith("r0-r1023: rows[0:10240000] in 1024 blocks of 10000")
    assert lines[3].endswith("r7:rows[0:50000]")
    assert lines[4] == (
        "  bytes per rank (weights + row-wise state): min 2.5 MiB (r0), median 2.5 MiB, "
        "max 8.8 MiB (r7) over 1024 ranks"
    )
    assert max(len(line) for line in lines) < 160


def test_uneven_splits_and_ties_name_their_ranks() -> None:
    shards = [Shard(r, 10 * r + min(r, 2), 10 * (r + 1) + min(r + 1, 2), 0, 4) for r in range(10)]
    # ranks 0 and 1 hold 11 rows, the others 10: two runs
    assert shards_text(shards, 4) == (
        "r0-r1: rows[0:22] in 2 blocks of 11, r2-r9: rows[22:102] in 8 blocks of 10"
    )
    values = [5] * 6 + [9] * 4
    assert per_rank_text(values, str) == (
        "min 5 (r0), median 5, max 9 (r6, r7, r8, ...) over 10 ranks"
    )
    assert per_rank_text([3, 4], str) == "r0: 3, r1: 4"  # few ranks: listed


def test_the_plan_command_prints_a_1024_rank_plan_and_its_traffic_quickly(
    capsys: pytest.CaptureFixture,
) -> None:
    """Issue-sized: a 1,024-rank plan with the expected bytes a step sends (about 3 s)."""
    code = main(
        [
            "plan",
            "--world-size",
            "1024",
            "--table",
            "users:100000000:64",
            "--table",
            "tiny:100:16",
            "--batch-per-rank",
            "512",
            "--ids-per-bag",
            "20",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    sent = next(line for line in lines if line.startswith("  bytes sent per rank and step"))
    assert sent.startswith("  bytes sent per rank and step (512 samples, 20 ids per bag): min ")
    assert sent.endswith("over 1024 ranks")
    predicted = lines[lines.index(sent) + 1 :]
    assert predicted[0] == (
        "predicted per step on cpu-host (1024 ranks, 1024 a node; 512 samples a rank)"
    )
    assert [line.split(":")[0] for line in predicted[1:]] == [
        "  step time (embeddings)",
        "  memory",
        "  sent on the node's links",
        "  received",
    ]
    assert all(line.endswith("over 1024 ranks") for line in predicted[1:])
