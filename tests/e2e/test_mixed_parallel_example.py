"""The mixed-parallel LM example: it learns on 2 ranks, and its checkpoint reshards to 1 and 3."""

from __future__ import annotations

import importlib
import json
import math
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
from launch import run_torchrun

import manualpar as mp
from manualpar.testing import run_distributed

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "mixed_parallel"
SMALL = (
    "--width",
    "32",
    "--depth",
    "2",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "24",
    "--eval-batch-size",
    "24",
    "--log-every",
    "10",
    "--val-every",
    "20",
    "--checkpoint-every",
    "20",
    "--no-progress",
)
STEPS = 40


def _run(script: str, *args: str, ranks: int = 2) -> str:
    """A script of the example under torchrun on `ranks` processes."""
    return run_torchrun(EXAMPLE / script, *args, nproc=ranks, timeout=90, check=True).stdout


def _eval_loss(out: str) -> float:
    return float(re.search(r"eval loss (\d+\.\d+)", out).group(1))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One 2-rank training run shared by the tests: its directory and what it printed."""
    out = tmp_path_factory.mktemp("mixed")
    return out, _run("train.py", "--out", str(out), "--steps", str(STEPS), *SMALL, ranks=2)


@pytest.mark.timeout(120)
def test_learns_on_two_ranks(run: tuple[Path, str]) -> None:
    out, printed = run
    assert "blocks FSDPSequential" in printed and "embed  DistributedDataParallel" in printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == STEPS // 10 and losses[-1] < losses[0] - 0.15  # about 2.77 -> 2.53
    recorded = [r["val/loss"] for r in records if "val/loss" in r]
    assert len(recorded) == 2 and math.isclose(_eval_loss(printed), recorded[-1], rel_tol=1e-6)
    assert mp.latest_checkpoint(out / "checkpoints") == out / f"checkpoints/step_{STEPS:08d}"


def _example(name: str) -> ModuleType:
    """An example script imported by its plain name, as its siblings import it. Only in
    run_distributed's child processes: there the names (data, model, ...) clash with nothing."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    return importlib.import_module(name)


def _reshard(out: str) -> tuple[int, int, float, float | None]:
    """reshard.py's evaluation on this child's world size."""
    strategy = mp.ManualParallelStrategy()
    result = _example("reshard").evaluate(strategy, Path(out))
    strategy.teardown()
    return result.saved_world_size, result.world_size, result.loss, result.recorded


def _train(*argv: str) -> None:
    _example("train").main(list(argv))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks", [1, 3])
def test_checkpoint_reshards_with_the_same_eval_loss(run: tuple[Path, str], ranks: int) -> None:
    out, printed = run
    results = run_distributed(_reshard, world_size=ranks, args=(str(out),))
    for saved_on, world, loss, recorded in results:
        assert (saved_on, world) == (2, ranks)
        assert math.isclose(loss, _eval_loss(printed), rel_tol=1e-5)
        assert recorded is not None and math.isclose(loss, recorded, rel_tol=1e-5)


@pytest.mark.timeout(60)
def test_resumes_on_one_process_and_trains_on(run: tuple[Path, str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(run[0], out)
    run_distributed(
        _train,
        world_size=1,
        args=("--out", str(out), "--steps", str(STEPS + 10), *SMALL, "--val-every", "10"),
    )
    latest = mp.latest_checkpoint(out / "checkpoints")
    assert latest is not None and mp.read_manifest(latest)["world_size"] == 1
    assert mp.read_manifest(latest)["step"] == STEPS + 10
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-2:] == [STEPS, STEPS + 10]
    evals = {r["step"]: r["val/loss"] for r in records if "val/loss" in r}
    assert evals[STEPS + 10] < evals[STEPS]  # still learning after the move to 1 process


@pytest.mark.timeout(60)
def test_resuming_with_another_model_shape_is_refused(run: tuple[Path, str]) -> None:
    out = run[0]
    before = (out / "config.json").read_text()
    [outcome] = run_distributed(
        _train,
        world_size=1,
        allow_failure=True,
        args=("--out", str(out), "--steps", str(STEPS + 10), *SMALL, "--depth", "3"),
    )
    assert outcome.error_type == "SystemExit" and "--depth 2 -> 3" in str(outcome.error)
    assert (out / "config.json").read_text() == before


@pytest.mark.timeout(120)
def test_fsdp_times_tp_on_four_ranks_trains_as_the_flat_run(
    run: tuple[Path, str], tmp_path: Path
) -> None:
    """--mesh fsdp-tp (dp=2 x tp=2: each block's MLP split over a pair of ranks) reaches the
    eval loss of the 2-rank flat run: the layout changes where the math runs, not the math."""
    printed = _run(
        "train.py",
        "--out",
        str(tmp_path),
        "--steps",
        str(STEPS),
        *SMALL,
        "--mesh",
        "fsdp-tp",
        ranks=4,
    )
    assert "blocks FSDPSequential" in printed
    assert math.isclose(_eval_loss(printed), _eval_loss(run[1]), rel_tol=1e-5)
