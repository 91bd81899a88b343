"""2-D (replicate, shard) sharded tables on 4 ranks of 2 simulated nodes.

Each row of the mesh (a node) holds a sharded copy; the tables must train to the numbers of the
single-process reference for the whole job's loss (outputs, tables, optimizer state), every
replica must hold bit-identical blocks and state, and what needs the whole job (global
clipping, a frozen table, a sequence collection) must equal the 1-D collection over 4 ranks.
Checkpoints written by the 2x2 job load into 1, 2, 3 and 4 ranks (1-D), and 1-D into 2-D.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from embedding_cases import SEED, TABLES, assert_close, reference
from tables_2d_cases import BATCHES, TRAINED, checkpoint_job, matches, train_2d

from manualpar.embeddings import EmbeddingBagCollection
from manualpar.testing import run_distributed

pytestmark = pytest.mark.timeout(300)


def _replicas_identical(per_rank: list[dict], key: str) -> None:
    """Ranks r and r + 2 hold the same blocks (the same shard rank in two replicas)."""
    for rank in (0, 1):
        mine, twin = per_rank[rank][key]["blocks"], per_rank[rank + 2][key]["blocks"]
        assert mine.keys() == twin.keys()
        for name, tensor in mine.items():
            assert torch.equal(tensor, twin[name]), f"{key}: {name} differs on rank {rank + 2}"


def _same(got: dict, expected: dict, what: str) -> None:
    for name, tensor in expected["tables"].items():
        assert_close(got["tables"][name], tensor, f"{what}: table {name}")
        for key, value in expected["state"][name].items():
            assert_close(got["state"][name][key], value, f"{what}: state {name}/{key}")


def test_2d_tables_train_like_the_reference_and_replicas_agree():
    per_rank = run_distributed(train_2d, 4, local_world_size=2)
    for kind, opt_name, normalize in TRAINED:
        ref_first, ref_tables, ref_state = reference(opt_name, BATCHES, normalize=normalize)
        for rank, results in enumerate(per_rank):
            got, where = results[kind], f"{kind}/{opt_name}/{normalize}, rank {rank}"
            assert got["plan_size"] == 2
            assert_close(got["first"], ref_first[rank], f"{where}: step-0 output")
            _same(got, {"tables": ref_tables, "state": ref_state}, where)
        _replicas_identical(per_rank, kind)
    initial = EmbeddingBagCollection(TABLES, seed=SEED).tables["t2"].weight.detach()
    for rank, results in enumerate(per_rank):
        _same(results["clip_2d"], results["clip_1d"], f"clipped 2-D vs 1-D, rank {rank}")
        assert torch.equal(results["clip_2d"]["tables"]["t2"], initial), "frozen t2 moved"
        _same(results["seq_2d"], results["seq_1d"], f"sequence 2-D vs 1-D, rank {rank}")
        assert results["auto"]["plan_size"] == 2, "plan='auto' plans for the shard dim"
        errors = results["errors"]
        assert matches(
            r"PlanError: .*plan is for 4 ranks, but the shard dim of the mesh "
            r"\(replicate=2, shard=2\) has 2.*make the plan for 2 ranks",
            errors["plan4"],
        ), errors["plan4"]
        assert matches(
            r"BuilderError: .*mesh=\(shard=2\).*covers 2 of the job's 4 ranks.*Pass the 2-D mesh",
            errors["shard_only"],
        ), errors["shard_only"]
        assert matches(
            r"BuilderError: .*1-D or 2-D \(replicate, shard\) mesh, "
            r"got a 3-D mesh \(a=1, b=2, c=2\)",
            errors["3d"],
        ), errors["3d"]
    for key in ("clip_2d", "seq_2d", "auto"):
        _replicas_identical(per_rank, key)


def _assert_equal(got: dict, expected: dict, what: str) -> None:
    assert got["step"] == expected["step"], what
    for name, tensor in expected["tables"].items():
        assert torch.equal(got["tables"][name], tensor), f"{what}: table {name}"
        for key, value in expected["state"][name].items():
            assert torch.equal(got["state"][name][key], value), f"{what}: state {name}/{key}"


def test_2d_checkpoints_reshard_to_1d_and_back(tmp_path: Path):
    two_d, one_d = str(tmp_path / "2d"), str(tmp_path / "1d")
    saved = run_distributed(
        checkpoint_job, 4, args=("2d", "mixed", range(2), None, two_d), local_world_size=2
    )
    # only the first replica (ranks 0, 1) writes table blocks and optimizer state
    assert [r["written"] for r in saved][2:] == [0, 0]
    assert all(r["written"] > 0 for r in saved[:2])
    expected = saved[0]
    (single,) = run_distributed(checkpoint_job, 1, args=("1d", "table_wise", range(0), two_d, None))
    _assert_equal(single, expected, "2x2 -> 1")
    for result in run_distributed(
        checkpoint_job, 2, args=("1d", "column_wise", range(0), two_d, None)
    ):
        _assert_equal(result, expected, "2x2 -> 2 column-wise")
    for result in run_distributed(
        checkpoint_job, 3, args=("1d", "row_wise", range(0), two_d, None)
    ):
        _assert_equal(result, expected, "2x2 -> 3 row-wise")
    # 4 ranks 1-D: load, one more step, save; the 2x2 job loads that
    four = run_distributed(
        checkpoint_job, 4, args=("1d", "mixed", range(2, 3), two_d, one_d), local_world_size=2
    )
    for result in run_distributed(
        checkpoint_job, 4, args=("2d", "row_wise", range(0), one_d, None), local_world_size=2
    ):
        _assert_equal(result, four[0], "1-D 4 -> 2x2 row-wise")
    # three steps through 2-D and 1-D land on the reference
    _, ref_tables, ref_state = reference("adam", BATCHES)
    _same(four[0], {"tables": ref_tables, "state": ref_state}, "2x2 (2 steps) + 1-D (1 step)")
