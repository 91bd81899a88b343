"""Write docs/examples/dcn.md from a real run: synthetic Criteo files, train.py on 2 processes
under torchrun at a fixed seed, then score.py on one process; the page shows what they printed.

    python examples/dcn/make_docs.py            # about a minute on 2 cores

tests/e2e/test_dcn_example.py fails when the plan on the page differs from the one train.py
prints: after a change to the planner or to the example's tables, run this again.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "examples" / "dcn.md"
DATA, OUT = Path("runs/dcn-data"), Path("runs/dcn")  # relative to ROOT: the page shows them
FILES = (("day_0", 51_200, 0), ("day_1", 51_200, 51_200), ("val", 4096, 102_400))
FLAGS = ["--criteo", str(DATA / "day_0"), str(DATA / "day_1"), "--criteo-val", str(DATA / "val")]
TRAIN = ["--out", str(OUT), "--no-progress", *FLAGS]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def run(command: list[str]) -> tuple[str, float]:
    """stdout of `command` run from the repository root, and its wall time in seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout, time.perf_counter() - started


def shown(command: list[str]) -> str:
    return " ".join("python" if part == sys.executable else part for part in command)


def validation_table() -> str:
    records = [json.loads(line) for line in (ROOT / OUT / "metrics.jsonl").read_text().splitlines()]
    rows = ["| step | AUC | log loss | normalized entropy | calibration |", "|---|---|---|---|---|"]
    for r in (r for r in records if "val/auc" in r):
        rows.append(
            f"| {r['step']} | {r['val/auc']:.4f} | {r['val/log_loss']:.4f} | "
            f"{r['val/normalized_entropy']:.4f} | {r['val/calibration']:.4f} |"
        )
    return "\n".join(rows)


def main() -> None:
    shutil.rmtree(ROOT / OUT, ignore_errors=True)
    (ROOT / DATA).mkdir(parents=True, exist_ok=True)
    writer = [sys.executable, "examples/recsys/write_criteo.py"]
    writes = [[*writer, str(DATA / n), "--samples", str(c), "--start", str(s)] for n, c, s in FILES]
    for command in writes:
        run(command)
    train = [*TORCHRUN, "examples/dcn/train.py", *TRAIN]
    trained, train_s = run(train)
    score = [sys.executable, "examples/dcn/score.py", *TRAIN[:2], *FLAGS]
    scored, score_s = run(score)
    template = (Path(__file__).parent / "page_template.md").read_text()
    page = template.format(
        writes="\n".join(shown(c) for c in writes),
        train=shown(train),
        trained=trained.strip(),
        train_s=f"{train_s:.1f}",
        table=validation_table(),
        score=shown(score),
        scored=scored.strip(),
        score_s=f"{score_s:.1f}",
        cores=os.cpu_count(),
        torch=torch.__version__,
        python=platform.python_version(),
    )
    PAGE.write_text(page)
    print(PAGE.relative_to(ROOT))


if __name__ == "__main__":
    main()
