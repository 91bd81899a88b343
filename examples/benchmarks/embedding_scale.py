"""bench_embeddings.py --scale: manualpar (and the peer) at growing table sizes, each variant's
step against its own at the first size."""

from __future__ import annotations

import argparse
import json
import statistics

from embedding_jobs import RANKS, launch, variants

__all__ = ["scale"]


def scale(args: argparse.Namespace) -> dict:
    """manualpar (and TorchRec, given --peer-python) at 1, 4 and 16 GiB of tables, equal
    lookups; (size, variant) jobs interleave in a rotating order over `--repeats`. Each variant's
    step time is compared with its own at the first size (median per size), so a slowdown the
    machine causes shows in both."""
    from memory_floor import Floors, describe

    names = [name for name in variants(args) if name != "baseline"]
    sizes = list(args.scale_gib)
    floors = Floors(RANKS)  # the host probed before the first job
    floor = {gib: floors.of(args, plan=args.plans[0], rows=_scale_rows(args, gib)) for gib in sizes}
    for gib in sizes:
        print(f"{gib:>4} GiB tables: {describe(floor[gib])}", flush=True)
    jobs = [(gib, name) for gib in sizes for name in names]
    runs: dict[str, dict[float, list[dict]]] = {name: {gib: [] for gib in sizes} for name in names}
    for repeat in range(args.repeats):
        shift = repeat % len(jobs)
        for gib, name in jobs[shift:] + jobs[:shift]:
            python, script, extra = variants(args)[name]
            rows = _scale_rows(args, gib)
            result = launch(python, script, extra, args, args.plans[0], rows)
            runs[name][gib].append(result)
            tables_state = args.tables * rows * (args.dim * 4 + 4) / 2**30
            result["rss_bound_gb"] = tables_state / 2 + 0.5
            print(
                f"repeat {repeat} {gib:>4} GiB tables {name:<9}: {result['ms_per_step']:7.1f} "
                f"ms/step, peak RSS per rank {max(result['peak_rss_gb_per_rank']):.2f} GiB "
                f"(bound {result['rss_bound_gb']:.2f}), init {result['init_s']:.1f} s, "
                f"{result['ms_per_step'] / floor[gib]['ms']:.1f}x the memory floor",
                flush=True,
            )
    summaries = {name: _scale_summary(runs[name], sizes, floor) for name in names}
    summary = summaries["manualpar"]
    for name in names[1:]:  # torchrec and the no-exchange floor (--floor), each on its own
        summary[name] = summaries[name]
    print(json.dumps(summary, indent=2))
    return {
        "summary": summary,
        "runs": {f"{gib}GiB": r for gib, r in runs["manualpar"].items()},
        **{f"{name}_runs": {f"{gib}GiB": r for gib, r in runs[name].items()} for name in names[1:]},
    }


def _scale_rows(args: argparse.Namespace, gib: float) -> int:
    """Rows per table for `gib` GiB of float32 tables."""
    return int(gib * 2**30 / (args.tables * args.dim * 4))


def _scale_summary(runs: dict[float, list[dict]], sizes: list[float], floor: dict) -> dict:
    first = statistics.median(r["ms_per_step"] for r in runs[sizes[0]])
    summary = {}
    for gib, results in runs.items():
        median_ms = statistics.median(r["ms_per_step"] for r in results)
        summary[f"{gib}GiB"] = {
            "median_ms_per_step": median_ms,
            f"vs_{sizes[0]}GiB": median_ms / first,
            "max_peak_rss_gb": max(max(r["peak_rss_gb_per_rank"]) for r in results),
            "rss_bound_gb": results[0]["rss_bound_gb"],
            "median_init_s": statistics.median(r["init_s"] for r in results),
            "memory_floor": floor[gib],
            "x_memory_floor": median_ms / floor[gib]["ms"],
        }
    return summary
