"""Plot a run's metrics.jsonl (written by the Trainer) to a PNG: one panel per metric, or per
metric whose name starts with one of `--keys` (`--keys time/`: where the timed steps' time
went, loop/step_times.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from manualpar import ManualParError

__all__ = ["add_arguments", "metrics_figure", "plot_metrics", "run"]


def plot_metrics(
    run_dir: str | Path, out: str | Path | None = None, keys: Sequence[str] = ()
) -> Path:
    """Write `<run_dir>/metrics.png` (or `out`); returns its path. `keys`: plot only the
    metrics whose names start with one of these (all if empty)."""
    run_dir = Path(run_dir)
    source = run_dir / "metrics.jsonl"
    if not source.is_file():
        raise ManualParError(f"no metrics.jsonl in {run_dir}; pass the Trainer's out_dir")
    series: dict[str, tuple[list[int], list[float]]] = {}
    for number, line in enumerate(source.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ManualParError(f"{source}:{number} is not valid JSON") from None
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)):
                steps, values = series.setdefault(name, ([], []))
                steps.append(record["step"])
                values.append(float(value))
    if not series:
        raise ManualParError(f"{source} holds no numeric metrics")
    if keys:
        chosen = {name: s for name, s in series.items() if name.startswith(tuple(keys))}
        if not chosen:
            raise ManualParError(
                f"{source} holds no metric starting with {' or '.join(map(repr, keys))}; it "
                f"holds {', '.join(sorted(series))}. Pass one of these (or a start of one) to "
                "--keys"
            )
        series = chosen
    figure = metrics_figure(series, str(run_dir))
    target = Path(out) if out else run_dir / "metrics.png"
    figure.savefig(target, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return target


def metrics_figure(series: dict[str, tuple[list[int], list[float]]], title: str) -> Any:
    """One panel per metric, stacked, sharing the step axis; `title` above them all."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ManualParError("plotting needs matplotlib: pip install 'manualpar[plot]'") from None
    # The constrained layout reserves room for the title; tight_layout() ignores a suptitle,
    # which then overlapped the top panel.
    figure, axes = plt.subplots(
        len(series),
        1,
        figsize=(7, 2.2 * len(series)),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    for axis, (name, (steps, values)) in zip(axes[:, 0], sorted(series.items()), strict=True):
        axis.plot(steps, values, marker="." if len(steps) < 50 else None)
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(title)
    return figure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    parser.add_argument(
        "--keys",
        nargs="+",
        default=(),
        metavar="PREFIX",
        help="plot only the metrics whose names start with one of these (e.g. time/ for the "
        "step times of Trainer(step_times_every=N))",
    )


def run(args: argparse.Namespace) -> int:
    print(plot_metrics(args.run_dir, args.out, args.keys))
    return 0
