"""The DCN-v2 example as a user runs it, in two training runs (the only ones of this file): an
uninterrupted run under torchrun, whose printed plan must be the one on docs/examples/dcn.md,
and a self-launched run (`--processes 2 --restarts 1`) whose rank 1 is SIGKILLed mid-training,
which must resume to the same checkpoint bit for bit; then one-process scoring of that run
equal to its validation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from example_modules import EXAMPLES, load_example
from launch import output_tail, run_python, run_torchrun
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import manualpar as mp

DCN = EXAMPLES / "dcn"
PAGE = EXAMPLES.parent / "docs" / "examples" / "dcn.md"
recsys_data = load_example(Path("recsys/data.py"), "dcn_test_recsys_data")
criteo = load_example(Path("recsys/write_criteo.py"), "dcn_test_write", {"data": recsys_data})
STEPS, KILL_AT = 12, 6


def plan_block(text: str) -> str:
    """The lines of the printed plan: its title, then its indented lines."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("embedding plan for "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), None)
    return "\n".join(lines[start:end])


@pytest.fixture(scope="module")
def flags(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Criteo-format files (one per rank: 128 lines a step each) and the run settings; the
    tables are the example's defaults, so the plan is the page's."""
    data = tmp_path_factory.mktemp("data")
    files = [
        criteo.write_synthetic_criteo(data / name, lines, start=start)
        for name, lines, start in (("day_0", 1536, 0), ("day_1", 1536, 1536), ("val", 1024, 3072))
    ]
    return ["--criteo", str(files[0]), str(files[1]), "--criteo-val", str(files[2]),
            "--steps", str(STEPS), "--batch", "256", "--val-samples", "1024", "--val-every", "4",
            "--checkpoint-every", "4", "--log-every", "1", "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def straight(flags: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("straight")
    result = run_torchrun(DCN / "train.py", "--out", str(out), *flags, timeout=180, check=True)
    return out, result.stdout


@pytest.fixture(scope="module")
def killed(flags: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("killed")
    args = ["--out", str(out), *flags, "--processes", "2", "--restarts", "1"]
    result = run_python(DCN / "train.py", *args, "--kill-rank-at-step", str(KILL_AT), timeout=240)
    assert result.returncode == 0, output_tail(result)
    return out, result.stdout


def test_the_printed_plan_is_the_one_on_the_docs_page(straight: tuple[Path, str]) -> None:
    printed = plan_block(straight[1])
    assert "cat_2                  131072 x 16   row_wise on disk" in printed
    assert printed == plan_block(PAGE.read_text()), (
        "the plan train.py prints is not the one on docs/examples/dcn.md: run "
        "python examples/dcn/make_docs.py to write the page from a run"
    )


def _tensors(checkpoint: Path, into: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole (DCP's one-process conversion)."""
    dcp_to_torch_save(checkpoint, into)
    flat: dict[str, torch.Tensor] = {}

    def walk(value: object, key: str) -> None:
        if isinstance(value, dict):
            for name, inner in value.items():
                walk(inner, f"{key}/{name}")
        elif isinstance(value, torch.Tensor):
            flat[key] = value

    walk(torch.load(into, weights_only=False), "")
    return flat


def _records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in r.items() if k != "steps_per_s"} for r in map(json.loads, lines)]


def test_a_rank_killed_mid_training_resumes_to_the_uninterrupted_run(
    straight: tuple[Path, str], killed: tuple[Path, str], tmp_path: Path
) -> None:
    assert "restarts: 0" in straight[1] and "restarts: 1" in killed[1]
    final = f"checkpoints/step_{STEPS:08d}"
    assert mp.latest_checkpoint(killed[0] / "checkpoints") == killed[0] / final
    expected = _tensors(straight[0] / final, tmp_path / "straight.pt")
    got = _tensors(killed[0] / final, tmp_path / "killed.pt")
    assert sorted(got) == sorted(expected)
    assert any(k.startswith("/model/head.cross.") for k in got)  # the FSDP-sharded cross net
    assert any(k.startswith("/sparse_optim/state/cat_2") for k in got)  # the disk table's state
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key
    losses = [(r["step"], r["loss"]) for r in _records(straight[0]) if "loss" in r]
    assert len(losses) == STEPS
    assert [(r["step"], r["loss"]) for r in _records(killed[0]) if "loss" in r] == losses
    validations = [r for r in _records(straight[0]) if "val/auc" in r]
    assert len(validations) == STEPS // 4
    assert [r for r in _records(killed[0]) if "val/auc" in r] == validations


def test_one_process_scoring_equals_the_validation_bit_for_bit(
    flags: list[str], killed: tuple[Path, str], tmp_path: Path
) -> None:
    scores = tmp_path / "scores.pt"
    result = run_python(DCN / "score.py", "--out", str(killed[0]), *flags, "--scores", str(scores),
                        timeout=120, check=True)  # fmt: skip
    compared = re.findall(r"^(\w+) +\S+ +validation \S+ +(\w+)$", result.stdout, re.MULTILINE)
    assert compared == [
        (name, "equal")
        for name in ("auc", "log_loss", "normalized_entropy", "calibration", "count")
    ], result.stdout
    assert torch.load(scores, weights_only=True).shape == (1024,)
