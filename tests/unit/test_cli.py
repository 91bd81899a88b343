"""`manualpar inspect` on real checkpoints and `manualpar plot`, called in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_models import make_model
from png_checks import assert_plots_every_metric, line_bands, metric_names

import manualpar as mp
from manualpar.cli import main


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    strategy = mp.ManualParallelStrategy()
    model = make_model(seed=0)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1), "step": 7}
    strategy.save_checkpoint(tmp_path / "step_7", state)
    strategy.save_checkpoint(tmp_path / "full.pt", state, full=True)
    return tmp_path


def test_inspect_sharded_checkpoint(checkpoints: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", str(checkpoints / "step_7")]) == 0
    out = capsys.readouterr().out
    assert "kind sharded, step 7, saved by 1 rank(s)" in out
    assert "entries: model (module), optim (optimizer), step (value)" in out
    assert [line.split()[:2] for line in out.splitlines() if "model/0.weight" in line] == [
        ["model/0.weight", "8x4"]
    ]


def test_inspect_json_of_full_export(checkpoints: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["inspect", "--json", str(checkpoints / "full.pt")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "full" and info["step"] == 7 and info["world_size"] == 1
    assert info["tensors"]["model/2.weight"] == {
        "shape": [2, 8],
        "dtype": "torch.float32",
        "chunks": 1,
    }


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    records = [{"step": s, "loss": 1.0 / s, "lr": 0.1} for s in range(1, 6)]
    records.append({"step": 5, "val/loss": 0.3})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["plot", str(tmp_path)]) == 0
    png = tmp_path / "metrics.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert metric_names(tmp_path / "metrics.jsonl") == {"loss", "lr", "val/loss"}
    assert_plots_every_metric(png, tmp_path / "metrics.jsonl")  # one plotted panel each


def test_plot_keys_draws_only_the_step_times(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    times = {"time/read": 0.001, "time/lookup": 0.004, "time/step": 0.01}
    records = [{"step": s, "loss": 1.0 / s} for s in range(1, 7)]
    records += [{"step": s, **times} for s in (3, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    png = tmp_path / "times.png"
    assert main(["plot", str(tmp_path), "--out", str(png), "--keys", "time/"]) == 0
    assert line_bands(png) == len(times)  # one panel per phase, none for the loss
    assert main(["plot", str(tmp_path), "--keys", "tme/", "val/"]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'metrics.jsonl'} holds no metric starting with 'tme/' or 'val/'; "
        "it holds loss, time/lookup, time/read, time/step. Pass one of these (or a start of "
        "one) to --keys\n"
    )


def test_plot_without_metrics_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: no metrics.jsonl in {tmp_path}; pass the Trainer's out_dir"
    )


def test_inspect_a_run_folder_describes_its_latest_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    strategy = mp.ManualParallelStrategy()
    model = make_model(seed=0)
    for step in (3, 12, 8):
        strategy.save_checkpoint(
            tmp_path / "checkpoints" / f"step_{step}", {"model": model, "step": step}
        )
    for target in (tmp_path, tmp_path / "checkpoints"):
        assert main(["inspect", "--json", str(target)]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["path"] == str(tmp_path / "checkpoints" / "step_12") and info["step"] == 12
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["inspect", str(empty)]) == 2
    assert capsys.readouterr().err == (
        f"error: {empty} is not a checkpoint and holds no committed checkpoint (nor does "
        f"{empty / 'checkpoints'}); pass a checkpoint directory or a full export\n"
    )


@pytest.mark.parametrize("panels", [1, 3])
def test_plot_title_sits_above_the_top_panel(panels: int) -> None:
    from manualpar.cli.plot import metrics_figure

    series = {f"metric{i}": ([1, 2, 3], [1.0, 0.5, 0.25]) for i in range(panels)}
    figure = metrics_figure(series, "runs/a-long-run-directory-name/with/parts")
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    title = figure.get_suptitle() and figure._suptitle.get_window_extent(renderer)
    top = figure.axes[0].get_tightbbox(renderer)  # the panel with its tick labels
    assert title.y0 >= top.y1, f"title {title} overlaps the top panel {top}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "0"], "error: launch --nproc 0: expected processes per node, at least 1"),
        (["--max-restarts", "-1"], "error: launch --max-restarts -1: expected 0 or more"),
    ],
)
def test_launch_refuses_counts_out_of_range_before_starting_torchrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, args: list[str], message: str
) -> None:
    def execv(*_: object) -> None:
        raise AssertionError("torchrun started")

    monkeypatch.setattr("manualpar.cli.launch.os.execv", execv)
    assert main(["launch", *args, "train.py"]) == 2
    assert capsys.readouterr().err == message + "\n"


def test_plan_with_a_disk_cache_and_a_pin_prints_the_plan_the_job_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from manualpar.embeddings import DiskTier, EmbeddingBagConfig, EmbeddingPlan, row_wise
    from manualpar.embeddings.planning.planner import default_topology, plan_tables

    tables = ["--table", "mid:10000000:16", "--table", "big:20000000:16", "--table", "s:1000:16"]
    budget = ["--world-size", "2", "--memory-budget", "1200MB", "--disk-cache", "64MiB"]
    out = tmp_path / "plan.json"
    assert main(["plan", *tables, *budget, "--pin", "mid=disk", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "  mid " in printed and "row_wise on disk" in printed and "(pinned: " in printed
    job = plan_tables(
        [EmbeddingBagConfig(*t.split(":")[:1], *map(int, t.split(":")[1:])) for t in tables[1::2]],
        2,
        memory_budget_bytes=1_200_000_000,
        disk_tier=DiskTier(tmp_path, cache_bytes=64 * 2**20),
        pinned={"mid": row_wise(on_disk=True)},
        topology=default_topology(2, 2),
    )
    assert EmbeddingPlan.from_json(out.read_text()) == job
    assert main(["plan", *tables, "--world-size", "2", "--pin", "mid=disk"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "pinned= puts tables ['mid'] on disk, but no disk tier was given; pass "
            "disk_tier=DiskTier(directory, cache_bytes=...)"
        )
    )


def test_inspect_shows_the_records_a_load_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A raw-id table's setting, recorded in the manifest (and a full export's header), is
    what a load compares: inspect prints it, so a refused load can be understood from disk."""
    from manualpar.embeddings import EmbeddingBagCollection, EmbeddingBagConfig, HashIds

    tables = EmbeddingBagCollection([EmbeddingBagConfig("t", 8, 2, raw_ids=HashIds(salt=3))])
    strategy = mp.ManualParallelStrategy()
    strategy.save_checkpoint(tmp_path / "c", {"model": tables})
    strategy.save_checkpoint(tmp_path / "full.pt", {"model": tables}, full=True)
    for path in (tmp_path / "c", tmp_path / "full.pt"):
        assert main(["inspect", "--json", str(path)]) == 0
        records = json.loads(capsys.readouterr().out)["records"]
        assert records["model"]["tables"]["t"]["rows"] == 8
        assert records["model"]["tables"]["t"]["raw_ids"]["salt"] == 3
    assert main(["inspect", str(tmp_path / "c")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "record model:" in x)
    assert '"salt": 3' in line
