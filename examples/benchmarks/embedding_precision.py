"""bench_embeddings.py --precision: half tables, manualpar fp16/bf16/fp32 against TorchRec's
FP16/FP32 (PRECISION_RATIOS), step time and peak RSS per process."""

from __future__ import annotations

import argparse
import json
import statistics

from embedding_jobs import RANKS, launch, variants

__all__ = ["PRECISION_RATIOS", "PRECISION_VARIANTS", "precision"]


# --precision: (variant, manualpar or the peer, --dtype); the ratios it reports (mine, theirs)
PRECISION_VARIANTS = (
    ("manualpar fp16", "manualpar", "fp16"),
    ("torchrec fp16", "torchrec", "fp16"),
    ("manualpar bf16", "manualpar", "bf16"),
    ("torchrec fp32", "torchrec", "fp32"),
    ("manualpar fp32", "manualpar", "fp32"),
)
PRECISION_RATIOS = (
    ("manualpar fp16", "torchrec fp16"),
    ("manualpar bf16", "torchrec fp32"),
    ("manualpar fp16", "torchrec fp32"),
    ("manualpar fp32", "torchrec fp32"),
    ("manualpar bf16", "manualpar fp32"),
)


def precision(args: argparse.Namespace) -> dict:
    """Half tables against TorchRec's: every (variant, dtype) job of PRECISION_VARIANTS in a
    rotating order per repeat; per plan, the median over repeats of each pair's ratio of step
    time and of peak RSS per process."""
    if not args.peer_python:
        raise SystemExit("--precision compares with TorchRec: pass --peer-python")
    from memory_floor import Floors, describe

    found = variants(args)
    floors = Floors(RANKS)  # the host probed before the first job
    floor = {
        (plan, dtype): floors.of(args, plan=plan, dtype=dtype)
        for plan in args.plans
        for dtype in {dtype for _, _, dtype in PRECISION_VARIANTS}
    }
    jobs = [(plan, name) for plan in args.plans for name, _, _ in PRECISION_VARIANTS]
    runs: dict[str, dict[str, list[dict]]] = {plan: {} for plan in args.plans}
    for repeat in range(args.repeats):
        shift = repeat % len(jobs)
        for plan, name in jobs[shift:] + jobs[:shift]:
            _, kind, dtype = next(v for v in PRECISION_VARIANTS if v[0] == name)
            python, script, extra = found[kind]
            result = launch(python, script, [*extra, "--dtype", dtype], args, plan, args.rows)
            runs[plan].setdefault(name, []).append(result)
            print(
                f"repeat {repeat} {plan:<10} {name:<15} {result['ms_per_step']:7.1f} ms/step  "
                f"cpu {result.get('cpu_ms_per_step') or float('nan'):6.1f} ms  "
                f"peak RSS {max(result['peak_rss_gb_per_rank']):.2f} GiB",
                flush=True,
            )
    summary: dict[str, dict] = {}
    for plan, by_name in runs.items():
        summary[plan] = {
            f"{mine} / {theirs}": {
                key: statistics.median(
                    value(a) / value(b) for a, b in zip(by_name[mine], by_name[theirs], strict=True)
                )
                for key, value in (
                    ("ms_per_step", lambda r: r["ms_per_step"]),
                    ("peak_rss", lambda r: max(r["peak_rss_gb_per_rank"])),
                    ("cpu_ms_per_step", lambda r: r.get("cpu_ms_per_step") or float("nan")),
                )
            }
            for mine, theirs in PRECISION_RATIOS
        }
        summary[plan]["median_ms_per_step"] = {
            name: statistics.median(r["ms_per_step"] for r in results)
            for name, results in by_name.items()
        }
        summary[plan]["max_peak_rss_gb"] = {
            name: max(max(r["peak_rss_gb_per_rank"]) for r in results)
            for name, results in by_name.items()
        }
        dtype_of = {name: dtype for name, _, dtype in PRECISION_VARIANTS}
        summary[plan]["memory_floor"] = {d: f for (p, d), f in floor.items() if p == plan}
        summary[plan]["x_memory_floor"] = {
            name: ms / floor[plan, dtype_of[name]]["ms"]
            for name, ms in summary[plan]["median_ms_per_step"].items()
        }
        for dtype, one in summary[plan]["memory_floor"].items():
            print(f"{plan} {dtype}: {describe(one)}", flush=True)
        print(
            f"{plan}: step / memory floor: "
            + ", ".join(f"{n} {x:.1f}x" for n, x in summary[plan]["x_memory_floor"].items()),
            flush=True,
        )
    print(json.dumps(summary, indent=2))
    return {"summary": summary, "runs": runs}
