"""What `import manualpar` costs a process over `import torch` (every torchrun worker and every
test process pays it), optionally against another checkout of the package.

    python examples/benchmarks/bench_import.py --repeats 7 --json runs/bench_import.json
    python examples/benchmarks/bench_import.py --other /path/to/other/checkout   # old vs new

Each measurement is a fresh interpreter (`python -c "import X"`, stdlib warm in the page cache):
wall and CPU seconds (user + system of the child). Variants run interleaved, in a rotating
order, and the report gives medians and the median per-repeat difference to `import torch`.
It also lists which heavy torch modules the import left loaded (they should be none).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HEAVY = (
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.optim",
)


def measure(code: str, path: Path | None) -> tuple[float, float]:
    """(wall s, CPU s) of a fresh interpreter running `code`, importing from `path`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path is not None:
        env["PYTHONPATH"] = str(path)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=path or REPO)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def loaded_heavy(path: Path) -> list[str]:
    probe = f"import sys, manualpar; print([m for m in {HEAVY!r} if m in sys.modules])"
    env = {**os.environ, "PYTHONPATH": str(path)}
    out = subprocess.run(  # from `path`: `python -c` puts the working directory first
        [sys.executable, "-c", probe], env=env, check=True, capture_output=True, text=True, cwd=path
    )
    return json.loads(out.stdout.strip().replace("'", '"'))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--other", type=Path, help="another checkout to compare (e.g. older)")
    parser.add_argument("--json")
    args = parser.parse_args()
    variants = {"torch": ("import torch", REPO), "manualpar": ("import manualpar", REPO)}
    if args.other is not None:
        variants["other manualpar"] = ("import manualpar", args.other.resolve())
    names = list(variants)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    measure("import torch", REPO)  # warm the page cache
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            samples[name].append(measure(*variants[name]))
    report: dict[str, object] = {"repeats": args.repeats}
    for name in names:
        walls, cpus = zip(*samples[name], strict=True)
        pairs = zip(samples[name], samples["torch"], strict=True)
        over = [(w - tw, c - tc) for (w, c), (tw, tc) in pairs]
        row = {
            "wall_s": statistics.median(walls),
            "cpu_s": statistics.median(cpus),
            "wall_over_torch_s": statistics.median(o[0] for o in over),
            "cpu_over_torch_s": statistics.median(o[1] for o in over),
        }
        report[name] = row
        print(
            f"{name:>16}: wall {row['wall_s']:.2f} s, CPU {row['cpu_s']:.2f} s; over import "
            f"torch: wall {row['wall_over_torch_s']:+.2f} s, CPU {row['cpu_over_torch_s']:+.2f} s"
        )
    heavy = {"manualpar": loaded_heavy(REPO)}
    if args.other is not None:
        heavy["other manualpar"] = loaded_heavy(args.other.resolve())
    report["heavy_modules_loaded"] = heavy
    print("heavy torch modules left loaded:", heavy)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
