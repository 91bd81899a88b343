"""The embedding benchmark's id distributions (`--ids zipf`): every variant, manualpar's and
TorchRec's, gets the same ids, and they have the skew asked for.

Running the benchmarks at toy size is in tests/e2e/test_benchmarks.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from example_modules import load_example

workload = load_example(Path("benchmarks/embedding_workload.py"), "bench_embedding_workload")


def _workload(*flags: str) -> argparse.Namespace:
    """The workload as a worker (manualpar's or the peer's) parses it from its command line."""
    parser = argparse.ArgumentParser()
    workload.add_workload_args(parser)
    return parser.parse_args(["--result", "unused.json", *flags])


ZIPF = ("--ids", "zipf", "--zipf-exponent", "1.05", "--rows", "1000", "--tables", "2")


@pytest.mark.parametrize("lengths", ["fixed", "uniform"])
def test_zipf_ids_are_the_same_however_and_whenever_a_variant_draws_them(lengths: str) -> None:
    args = _workload(*ZIPF, "--lengths", lengths, "--batch", "64")
    direct = [workload.batch_features(args, rank, 2, 0)[0] for rank in range(2)]
    assert not torch.equal(direct[0], direct[1])  # each rank its own batch
    assert torch.equal(direct[0], workload.batch_features(args, 0, 2, 0)[0])
    if lengths == "fixed":  # the baseline's and the floor's call: the same ids, table-major
        assert torch.equal(workload.batch_ids(args, 0, 2, 0).flatten(), direct[0])
    workload.predraw(args, 0, 2, steps=2)  # time_steps does this before its clock
    try:
        copy = workload.batch_features(args, 0, 2, 0)[0]
        assert torch.equal(copy, direct[0])
        copy.zero_()  # a variant's copy: the next step's caller gets the ids again
        assert torch.equal(workload.batch_features(args, 0, 2, 0)[0], direct[0])
        if lengths == "fixed":
            assert torch.equal(workload.batch_ids(args, 0, 2, 0).flatten(), direct[0])
    finally:
        workload._DRAWN.clear()
    uniform = _workload(*ZIPF[4:], "--lengths", lengths, "--batch", "64")
    assert not torch.equal(workload.batch_features(uniform, 0, 2, 0)[0], direct[0])


def test_zipf_ids_have_the_exponent_asked_for_with_the_hot_rows_spread() -> None:
    args = _workload(*ZIPF, "--batch", "4000", "--ids-per-bag", "25")
    ids = workload.batch_ids(args, 0, 2, 0)  # 2 tables x 50,000 ids of 1,000 rows
    for table in range(2):
        counts = torch.bincount(ids[table], minlength=1000).double()
        by_rank = counts[workload.row_permutation(1000, table)]  # rank k's row's count
        ranks = torch.arange(1, 21, dtype=torch.float64)
        slope = (
            torch.linalg.lstsq(
                torch.stack([ranks.log(), torch.ones(20, dtype=torch.float64)], 1),
                by_rank[:20].log().unsqueeze(1),
            )
            .solution[0]
            .item()
        )
        assert -slope == pytest.approx(1.05, abs=0.08)
        share = 1.0 / torch.arange(1, 1001, dtype=torch.float64).pow(-1.05).sum().item()
        assert by_rank[0].item() / 50_000 == pytest.approx(share, rel=0.05)
        hot = workload.row_permutation(1000, table)[:10]  # the 10 hottest rows: all over
        assert (hot < 500).any() and (hot >= 500).any() and hot.max() - hot.min() > 500
    assert not torch.equal(workload.row_permutation(1000, 0), workload.row_permutation(1000, 1))


def test_every_variants_job_gets_the_id_options(monkeypatch: Any, tmp_path: Path) -> None:
    """embedding_jobs.launch builds one command line for manualpar's workers and the peer's:
    the ids options reach both."""
    launcher = load_example(Path("benchmarks/job_launch.py"), "bench_job_launch")
    jobs = load_example(
        Path("benchmarks/embedding_jobs.py"),
        "bench_embedding_jobs",
        {"embedding_workload": workload, "job_launch": launcher},
    )
    seen: list[list[str]] = []

    def run(command: list[str], **_: Any) -> Any:  # subprocess.run, no process started
        seen.append(command)
        result = Path(command[command.index("--result") + 1])
        result.write_text(json.dumps({"ms_per_step": 1.0}))
        return launcher.subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(launcher.subprocess, "run", run)
    cli = argparse.Namespace(
        **vars(_workload(*ZIPF, "--zipf-exponent", "1.2")),
        peer_python="peer-python",
        skip_baseline=True,
        skip_padded=True,
        pipelined=False,
        floor=False,
        batch_tables=False,
    )
    for python, script, extra in jobs.variants(cli).values():
        jobs.launch(python, script, extra, cli, "row_wise", 1000)
    assert [command[0] for command in seen] == [sys.executable, "peer-python"]
    for command in seen:
        flags = command[command.index("--nproc-per-node") + 3 :]  # after the script
        if flags[0] == "--worker":  # manualpar's worker: its variant, then the workload
            flags = flags[2:]
        parser = argparse.ArgumentParser()
        workload.add_workload_args(parser)
        args = parser.parse_args(flags)
        assert (args.ids, args.zipf_exponent, args.rows) == ("zipf", 1.2, 1000)
