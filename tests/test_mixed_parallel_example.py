"""The mixed-parallel LM example: it learns on 2 ranks, and its checkpoint reshards to 1 and 3."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

import manualpar as mp
from manualpar.testing import run_distributed

EXAMPLE = Path(__file__).parent.parent / "examples" / "mixed_parallel"
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


def _load_data() -> ModuleType:
    """data.py under a unique name (the example's scripts import each other by plain name)."""
    spec = importlib.util.spec_from_file_location("mixed_parallel_data", EXAMPLE / "data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


data = _load_data()


def _run(script: str, *args: str, ranks: int = 1) -> str:
    """A script of the example under torchrun on `ranks` processes, or as a plain process."""
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "MASTER_PORT"}}
    launch = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        if ranks > 1
        else []
    )
    command = [sys.executable, *launch, str(EXAMPLE / script), *args]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=90,
        env={
            **env,
            "MANUALPAR_TIMEOUT_S": "30",
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


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


def test_data_is_split_over_ranks_and_follows_the_chain() -> None:
    text = data.MarkovText(vocab=8, seq_len=16, batch_size=12, eval_batch_size=6, seed=3)
    whole = text.sequences(5, 12)
    for world in (1, 2, 3):
        shares = [text.train(5, SimpleNamespace(rank=r, world_size=world)) for r in range(world)]
        assert torch.equal(torch.cat([inputs for inputs, _ in shares]), whole[:, :-1])
        assert torch.equal(torch.cat([targets for _, targets in shares]), whole[:, 1:])
    allowed = text.transition[whole[:, :-2], whole[:, 1:-1], whole[:, 2:]]
    assert bool((allowed > 0).all())  # every token is one of its pair's candidates
    assert not torch.equal(text.sequences(6, 12), whole)
    assert torch.equal(data.MarkovText(vocab=8, seq_len=16, seed=3).sequences(5, 12), whole)
    h = text.entropies()
    assert h.rate < h.best < h.first_order < h.unigram <= math.log(8)
    with pytest.raises(ValueError, match="multiple of the world size"):
        text.validation(0, SimpleNamespace(rank=0, world_size=4))
