"""The fused optimizer of sharded tables on 2 gloo ranks: torch's learning-rate schedulers drive
it (and resume from a checkpoint), it clips gradients per row and globally, and frozen tables
stay put and leave the backward exchange, all against the single-process reference
(tests/support/fused_optimizer_cases.py). The mixed plan puts every kind of placement side by
side: table-wise, row-wise, column-wise, table-row-wise and data-parallel (t3).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from embedding_cases import SEED, TABLES, assert_close, make_batch, mixed_plan, optimizer
from fused_optimizer_cases import ALL, Job, reference_run, run_jobs

import manualpar as mp
from manualpar.embeddings import EmbeddingBagCollection, shard_embeddings
from manualpar.testing import run_distributed

GRAD = "shard_embeddings: output gradient all_to_all"
DATA_PARALLEL = "shard_embeddings: data-parallel gradient all_reduce"
NORM = "shard_embeddings: gradient norm all_reduce"


def check_job(per_rank: list[dict], expected: dict, label: str, lrs: slice = slice(None)) -> None:
    """Every rank's lrs, tables and optimizer state equal the reference's."""
    for rank, got in enumerate(per_rank):
        where = f"{label}, rank {rank}"
        assert got["lrs"] == expected["lrs"][lrs], f"{where}: learning rates"
        for name, table in expected["tables"].items():
            assert_close(got["tables"][name], table, f"{where}: table {name}")
            for key, value in expected["state"][name].items():
                assert_close(got["state"][name][key], value, f"{where}: state {name}/{key}")


def by_job(results: list[list[dict]], index: int) -> list[dict]:
    return [ranks[index] for ranks in results]


@pytest.mark.timeout(120)
def test_torch_schedulers_drive_the_fused_update_like_torch_sgd():
    """StepLR, LambdaLR, CosineAnnealingLR, OneCycleLR, SequentialLR and ChainedScheduler over
    the fused optimizer: the lr each backward applies is the one torch's scheduler gives the
    reference optimizer at that step, and the tables follow."""
    jobs = [
        Job("sgd", 5, schedule="step"),
        Job("adagrad", 5, schedule="cosine"),
        Job("rowwise", 5, schedule="onecycle"),
        Job("adam", 5, schedule="sequential"),
        Job("sgd", 5, schedule="lambda"),
        Job("rowwise", 5, schedule="chained"),
    ]
    results = run_distributed(run_jobs, 2, args=(jobs,))
    for index, job in enumerate(jobs):
        expected = reference_run(job)
        assert len(set(expected["lrs"])) > 2, f"{job.schedule}: the schedule must move"
        check_job(by_job(results, index), expected, f"{job.opt} + {job.schedule}")


@pytest.mark.timeout(150)
def test_scheduler_and_optimizer_resume_the_same_schedule(tmp_path: Path):
    """2 steps, a checkpoint with the scheduler beside the fused optimizer, then 3 more steps
    in a new job (another plan): the same learning rates and tables as 5 uninterrupted steps."""
    first = [
        Job("rowwise", 2, schedule="cosine", save=str(tmp_path / "cosine")),
        Job("adam", 2, schedule="sequential", save=str(tmp_path / "sequential")),
        Job("sgd", 2, schedule="onecycle", save=str(tmp_path / "onecycle")),
    ]
    run_distributed(run_jobs, 2, args=(first,))
    resumed = [
        Job(job.opt, 5, start=2, plan="row_wise", schedule=job.schedule, load=job.save)
        for job in first
    ]
    results = run_distributed(run_jobs, 2, args=(resumed,))
    for index, job in enumerate(resumed):
        expected = reference_run(Job(job.opt, 5, schedule=job.schedule))
        check_job(by_job(results, index), expected, f"resumed {job.schedule}", slice(2, 5))


@pytest.mark.timeout(120)
def test_gradient_clipping_per_row_and_global_matches_the_reference():
    """Each rule with per-row clipping, global clipping or both (row-wise Adagrad's fused pass
    falls back to row sums), on the mixed plan and on column blocks (per-row clipping needs
    the full row's norm there)."""
    row, total = 0.05, 0.1
    jobs = [
        Job("sgd", 3, max_row_grad_norm=row),
        Job("rowwise", 3, max_row_grad_norm=row),
        Job("adagrad", 3, max_grad_norm=total),
        Job("rowwise", 3, max_grad_norm=total),
        Job("adam", 3, max_row_grad_norm=row, max_grad_norm=total),
        Job("sgd", 3, plan="column_wise", max_row_grad_norm=row, max_grad_norm=total),
    ]
    results = run_distributed(run_jobs, 2, args=(jobs,))
    for index, job in enumerate(jobs):
        expected = reference_run(job)
        label = f"{job.opt}, {job.plan}, row {job.max_row_grad_norm}, global {job.max_grad_norm}"
        if job.max_row_grad_norm is not None:
            assert expected["row_clipped"] > 0, f"{label}: no row was clipped"
        if job.max_grad_norm is not None:
            assert min(expected["norms"]) > total, f"{label}: the global clip did nothing"
        check_job(by_job(results, index), expected, label)
        norm_reductions = [
            [name for name, _ in step if name == NORM]
            for ranks in results
            for step in ranks[index]["collectives"]
        ]
        assert all(len(n) == (job.max_grad_norm is not None) for n in norm_reductions), label


@pytest.mark.timeout(150)
def test_frozen_tables_stay_and_leave_the_backward_exchange():
    frozen = frozenset({"t1", "t3"})  # row-wise and the data-parallel table
    jobs = [
        # frozen on the unsharded collection, then unfrozen after 2 steps
        Job("rowwise", 4, frozen=(frozen, frozen), freeze_before_sharding=True, snapshots=(2,)),
        # a table-wise and a column-wise table frozen after sharding
        Job("sgd", 4, frozen=(frozenset({"t0", "t2"}),) * 2, snapshots=(2,)),
        # the whole collection (emb.requires_grad_(False)): no backward at all
        Job("adagrad", 3, frozen=(ALL, ALL), snapshots=(2,)),
        # every sharded table frozen, only the data-parallel one trains
        Job("sgd", 2, frozen=(ALL - {"t3"},) * 2),
    ]
    results = run_distributed(run_jobs, 2, args=(jobs,))
    initial = reference_run(Job("sgd", 0))["tables"]
    for index, job in enumerate(jobs):
        expected = reference_run(job)
        per_rank = by_job(results, index)
        check_job(per_rank, expected, f"frozen {sorted(job.frozen[0])}")
        for rank, got in enumerate(per_rank):
            after = got["snapshots"].get(2, {})
            for name, table in after.items():
                reference = initial if name in job.frozen[0] else expected["snapshots"][2]
                assert_close(table, reference[name], f"rank {rank}, after 2 steps: {name}")
    rowwise, _, whole, sharded_frozen = (by_job(results, i) for i in range(4))
    for rank in range(2):
        frozen_step, live_step = rowwise[rank]["collectives"][0], rowwise[rank]["collectives"][2]
        assert [n for n, _ in frozen_step] == [GRAD], "t3 frozen: no data-parallel all_reduce"
        assert [n for n, _ in live_step] == [GRAD, DATA_PARALLEL]
        assert frozen_step[0][1] < live_step[0][1], "t1's gradient is still exchanged"
        assert whole[rank]["trains"] == [False, False, True]
        assert whole[rank]["collectives"][:2] == [[], []]
        assert [[n for n, _ in step] for step in sharded_frozen[rank]["collectives"]] == [
            [DATA_PARALLEL],
            [DATA_PARALLEL],
        ]


def freeze_on_one_rank() -> str:
    strategy = mp.ManualParallelStrategy()
    emb = shard_embeddings(
        EmbeddingBagCollection(TABLES, seed=SEED), strategy, mixed_plan(2), optimizer("sgd")
    )
    if strategy.rank == 1:
        emb.tables["t0"].weight.requires_grad_(False)
    try:
        emb(make_batch(strategy.rank, 0, 3))
    except mp.BuilderError as error:
        return str(error)
    finally:
        strategy.teardown()
    return "no error"


@pytest.mark.timeout(60)
def test_ranks_that_freeze_different_tables_all_stop_with_the_same_error():
    messages = run_distributed(freeze_on_one_rank, 2)
    assert (
        messages
        == [
            "shard_embeddings: the ranks freeze different tables (weight.requires_grad=False) "
            "(rank 0: none; rank 1: ['t0']); freeze and unfreeze tables identically on every rank "
            "before the same forward"
        ]
        * 2
    )
