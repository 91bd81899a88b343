"""docs/benchmarks.md's figures, drawn from the benchmarks' JSON files (`pip install .[plot]`).

    python examples/benchmarks/draw_figures.py --out docs \\
        --steps runs/bench_embeddings.json runs/bench_sequence_200k.json \\
        --scale runs/bench_scale.json --disk runs/bench_disk_tier.json

Each figure is drawn only when its input is given:
- bench-steps.png (`--steps`, bench_embeddings.py's comparison JSON, one or more): per workload
  and plan, manualpar's step and the memory floor (memory_floor.py) as multiples of TorchRec's
  step in the same run, each bar labelled with the step as a multiple of the floor;
- bench-scale.png (`--scale`, bench_embeddings.py --scale): the median step per table size,
  for every variant of the run, beside the memory floor at that size;
- bench-disk-cycle.png (`--disk`, bench_disk_tier.py): every timed step of each variant's median
  job (the repeat whose mean step is the median), in order (over a whole write-log cycle when
  the run timed one), against its mean with the log's drains; the legend gives each disk
  variant's mean step over the in-memory one (median of the run's repeats).

Only ratios within one run mean anything on a shared host, so every figure puts a run's numbers
beside each other, never beside another run's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

STEPS_PNG, SCALE_PNG, DISK_PNG = "bench-steps.png", "bench-scale.png", "bench-disk-cycle.png"
DPI = 80  # about 30-60 KB a figure


def step_bars(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One bar group per plan of a comparison run that has TorchRec in it: its label, manualpar
    / TorchRec, the floor / TorchRec and manualpar / floor (None without a floor)."""
    bars = []
    for plan, summary in payload["summary"].items():
        ratio = summary.get("manualpar/torchrec", {}).get("ms_per_step")
        if ratio is None:
            continue
        medians = summary["median_ms_per_step"]
        floor = summary.get("memory_floor", {}).get("ms")
        bars.append(
            {
                "label": workload_label(payload["args"], plan),
                "manualpar": ratio,
                "floor": floor / medians["torchrec"] if floor else None,
                "x_floor": medians["manualpar"] / floor if floor else None,
            }
        )
    return bars


def workload_label(args: dict[str, Any], plan: str) -> str:
    """A short name of a run's workload: kind, tables x rows x dim, lengths, plan."""
    kind = "sequence" if args.get("sequence") else "pooled"
    rows = args["rows"]
    size = f"{rows // 1_000_000}M" if rows % 1_000_000 == 0 else f"{rows // 1000}k"
    lengths = f", 0-{2 * args['ids_per_bag']} ids" if args.get("lengths") == "uniform" else ""
    return f"{kind} {args['tables']}x{size}x{args['dim']}{lengths}, {plan.replace('_', '-')}"


def draw_steps(payloads: list[dict[str, Any]], path: Path) -> None:
    plt = _pyplot()
    bars = [bar for payload in payloads for bar in step_bars(payload)]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.55 * len(bars)))
    rows = range(len(bars))
    ax.barh([r + 0.2 for r in rows], [b["manualpar"] for b in bars], 0.4, label="manualpar")
    ax.barh(
        [r - 0.2 for r in rows],
        [b["floor"] or 0 for b in bars],
        0.4,
        color="0.7",
        label="memory floor",
    )
    for r, bar in zip(rows, bars, strict=True):
        note = f"{bar['manualpar']:.2f}x" + (
            f" ({bar['x_floor']:.1f}x floor)" if bar["floor"] else ""
        )
        ax.text(bar["manualpar"] + 0.02, r + 0.2, note, va="center", fontsize=8)
    ax.axvline(1.0, color="k", linestyle="--", linewidth=1, label="TorchRec")
    ax.set_yticks(list(rows), [b["label"] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("step time / TorchRec's step in the same run")
    ax.set_xlim(0, max([1.3, *(b["manualpar"] + 0.45 for b in bars)]))
    ax.legend(fontsize=8, loc="lower right")
    _save(fig, path)


def draw_scale(payload: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    summary, sizes = payload["summary"], payload["args"]["scale_gib"]
    series = {"manualpar": summary} | {
        name: value
        for name, value in summary.items()
        if isinstance(value, dict) and f"{sizes[0]}GiB" in value
    }
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, by_size in series.items():
        ax.plot(sizes, [by_size[f"{g}GiB"]["median_ms_per_step"] for g in sizes], "o-", label=name)
    floors = [summary[f"{g}GiB"].get("memory_floor", {}).get("ms") for g in sizes]
    if all(floors):
        ax.plot(sizes, floors, "s--", color="0.5", label="memory floor")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{g:g}" for g in sizes])
    ax.set_xlabel("tables (GiB, all ranks)")
    ax.set_ylabel("ms per step (median)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    _save(fig, path)


def draw_disk(payload: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    summary = payload.get("summary", {})
    for variant, results in payload["runs"].items():
        job = _median_job(results)
        steps = job["timed_step_ms"]
        ratio = summary.get(variant, {}).get("mean_vs_memory")
        label = variant if ratio is None else f"{variant}: {ratio:.2f}x memory"
        (line,) = ax.plot(range(len(steps)), steps, linewidth=0.7, label=label)
        mean = job["mean_with_drains_ms"]
        ax.axhline(mean, color=line.get_color(), linestyle="--", linewidth=1)
    cycle = " over a whole write-log cycle" if payload["args"].get("cycle") else ""
    ax.set_title(f"every timed step{cycle} (dashed: mean with the log's drains)", fontsize=9)
    ax.set_yscale("log")
    ax.set_xlabel("timed step")
    ax.set_ylabel("ms")
    ax.legend(fontsize=8)
    _save(fig, path)


def _median_job(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The job whose mean step with the log's drains (the dashed line drawn) is the median of
    its variant's repeats (the lower middle one)."""
    ordered = sorted(results, key=lambda job: float(job["mean_with_drains_ms"]))
    return ordered[(len(ordered) - 1) // 2]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _pyplot().close(fig)
    print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", nargs="+", default=[], help="bench_embeddings.py JSON files")
    parser.add_argument("--scale", help="bench_embeddings.py --scale JSON")
    parser.add_argument("--disk", help="bench_disk_tier.py JSON")
    parser.add_argument("--out", default="docs", help="folder for the PNGs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.steps:
        draw_steps([_load(p) for p in args.steps], out / STEPS_PNG)
        written.append(out / STEPS_PNG)
    if args.scale:
        draw_scale(_load(args.scale), out / SCALE_PNG)
        written.append(out / SCALE_PNG)
    if args.disk:
        draw_disk(_load(args.disk), out / DISK_PNG)
        written.append(out / DISK_PNG)
    return written


def _load(path: str) -> dict[str, Any]:
    payload: dict[str, Any] = json.loads(Path(path).read_text())
    return payload


if __name__ == "__main__":
    main()
