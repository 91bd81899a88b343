"""The embedding benchmarks' memory floor (rows moved per rank, priced at the host's rates) and
the figures drawn from their JSON.

Running the benchmarks at toy size is in tests/e2e/test_benchmarks.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from example_modules import load_example
from png_checks import png_size

workload = load_example(Path("benchmarks/embedding_workload.py"), "bench_embedding_workload")
floor = load_example(
    Path("benchmarks/memory_floor.py"), "bench_memory_floor", {"embedding_workload": workload}
)
figures = load_example(Path("benchmarks/draw_figures.py"), "bench_draw_figures")

ROW = 4 * 4  # dim 4, float32
STATE = 4


def _workload(**fields: Any) -> argparse.Namespace:
    values = {
        "plan": "table_wise",
        "tables": 2,
        "rows": 50,
        "dim": 4,
        "batch": 8,
        "ids_per_bag": 3,
        "lengths": "fixed",
        "sequence": False,
        "dtype": "fp32",
    }
    return argparse.Namespace(**(values | fields))


def test_the_floor_prices_random_and_streamed_bytes_at_their_own_rates() -> None:
    traffic = floor.StepTraffic(random_read=3_000, random_write=1_000, stream=500)
    rates = floor.HostRates(stream=1_000.0, random_read=1_000.0, random_write=500.0)
    assert traffic.seconds(rates) == pytest.approx(3 + 2 + 0.5)


def test_table_wise_a_rank_reads_every_routed_id_and_rewrites_each_touched_row_once() -> None:
    args = _workload()
    ids = torch.cat([workload.batch_ids(args, sender, 2, 0)[0] for sender in range(2)])
    touched = ids.unique().numel()  # rank 0 holds table 0: both ranks' 4 bags x 3 ids of it
    assert touched < ids.numel() == 24  # 50 rows: some ids repeat
    assert floor.rank_traffic(args, 0, 2) == floor.StepTraffic(
        random_read=24 * ROW + touched * (ROW + STATE),
        random_write=touched * (ROW + STATE),
        stream=2 * (2 * 4) * 4 * 4,  # 8 pooled bags of table 0, written and their gradient read
    )
    rates = floor.HostRates(stream=1e6, random_read=1e6, random_write=1e6)
    slowest = max(floor.rank_traffic(args, r, 2).seconds(rates) for r in range(2))
    assert floor.step_floor(args, 2, rates)["ms"] == pytest.approx(1000 * slowest)


def test_row_wise_sequences_of_spread_lengths_route_each_id_to_one_block() -> None:
    args = _workload(plan="row_wise", sequence=True, lengths="uniform")
    lengths = workload.batch_lengths(args, 0, 2, 0)
    assert lengths.shape == (2 * 4,) and lengths.min() >= 0 and lengths.max() <= 6
    assert lengths.unique().numel() > 1
    ids, same = workload.batch_features(args, 0, 2, 0)
    assert torch.equal(same, lengths) and ids.numel() == int(lengths.sum())
    per_rank = [floor.rank_traffic(args, rank, 2) for rank in range(2)]
    looked_up = [(t.random_read - t.random_write) // ROW for t in per_rank]
    drawn = sum(int(workload.batch_lengths(args, s, 2, 0).sum()) for s in range(2))
    assert sum(looked_up) == drawn
    assert [t.stream for t in per_rank] == [2 * n * 4 * 4 for n in looked_up]  # a row per id


def test_draw_figures_writes_small_pngs_from_the_benchmarks_json(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    floor_of = {"ms": 10.0}
    steps = {
        "args": {"sequence": True, "rows": 200_000, "tables": 8, "dim": 64, "ids_per_bag": 20}
        | {"lengths": "uniform"},
        "summary": {
            "row_wise": {
                "manualpar/torchrec": {"ms_per_step": 0.75},
                "median_ms_per_step": {"manualpar": 30.0, "torchrec": 40.0},
                "memory_floor": floor_of,
            }
        },
    }
    scale = {
        "args": {"scale_gib": [0.5, 1.0]},
        "summary": {
            "0.5GiB": {"median_ms_per_step": 20.0, "memory_floor": floor_of},
            "1.0GiB": {"median_ms_per_step": 22.0, "memory_floor": floor_of},
            "torchrec": {
                "0.5GiB": {"median_ms_per_step": 30.0},
                "1.0GiB": {"median_ms_per_step": 31.0},
            },
        },
    }
    disk = {
        "args": {"cycle": True},
        "runs": {
            name: [{"timed_step_ms": [ms, ms * 1.5, ms * 9], "mean_with_drains_ms": ms * 4}]
            for name, ms in (("memory", 20.0), ("lru", 60.0))
        },
    }
    paths = []
    for name, payload in (("steps", steps), ("scale", scale), ("disk", disk)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(payload))
    assert figures.step_bars(steps) == [
        {
            "label": "sequence 8x200kx64, 0-40 ids, row-wise",
            "manualpar": 0.75,
            "floor": 0.25,
            "x_floor": 3.0,
        }
    ]
    out = tmp_path / "docs"
    argv = ["--out", str(out), "--steps", str(paths[0]), "--scale", str(paths[1])]
    written = figures.main([*argv, "--disk", str(paths[2])])
    assert sorted(p.name for p in written) == sorted(
        [figures.STEPS_PNG, figures.SCALE_PNG, figures.DISK_PNG]
    )
    for path in written:
        width, height = png_size(path)
        assert width > 300 and height > 100 and path.stat().st_size < 100_000


def test_the_disk_figure_draws_the_median_repeat_of_each_variant() -> None:
    repeats = [
        {"timed_step_ms": [float(i)], "mean_with_drains_ms": mean}
        for i, mean in enumerate([90.0, 30.0, 60.0, 10.0])
    ]
    assert figures._median_job(repeats)["timed_step_ms"] == [1.0]  # 30 ms: the lower middle
    assert figures._median_job(repeats[:3])["timed_step_ms"] == [2.0]  # 60 ms: the middle
