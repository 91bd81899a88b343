"""bench_embeddings.py's default mode: manualpar against the baseline, the peer and its own
optional steps and manualpar from --baseline-src (manualpar-baseline: its jobs import that
tree's manualpar), per plan, as medians of per-repeat ratios (and each against the memory
floor)."""

from __future__ import annotations

import argparse
import json
import statistics

import job_launch
from embedding_jobs import RANKS, launch, variants

__all__ = ["compare"]


def compare(args: argparse.Namespace) -> dict:
    from memory_floor import Floors, add_floor

    floors = Floors(RANKS)  # the host probed before the first job
    floor = {plan: floors.of(args, plan=plan) for plan in args.plans}
    runs: dict[str, dict[str, list[dict]]] = {}
    names = list(variants(args))
    for repeat in range(args.repeats):
        for plan in args.plans:
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for name in order:
                python, script, extra = variants(args)[name]
                source = job_launch.source_of(name, getattr(args, "baseline_src", None))
                result = launch(python, script, extra, args, plan, args.rows, pythonpath=source)
                runs.setdefault(plan, {}).setdefault(name, []).append(result)
                print(
                    f"repeat {repeat} {plan:<10} {name:<9} {result['ms_per_step']:7.1f} ms/step"
                    f" ({result['ms_per_step'] / floor[plan]['ms']:.1f}x the memory floor)"
                    + (f" cpu {result['cpu_ms_per_step']:6.1f} ms" if cpu_ms(result) else "")
                    + f"  init {result['init_s']:5.2f} s"
                    + (f" (cpu {result['init_cpu_s']:5.2f} s)" if "init_cpu_s" in result else "")
                    + "  peak RSS "
                    f"{max(result['peak_rss_gb_per_rank']):.2f} GiB",
                    flush=True,
                )
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for plan, by_name in runs.items():
        summary[plan] = {}
        for other in names[1:]:
            pairs = list(zip(by_name["manualpar"], by_name[other], strict=True))
            summary[plan][f"manualpar/{other}"] = {
                "ms_per_step": statistics.median(
                    a["ms_per_step"] / b["ms_per_step"] for a, b in pairs
                ),
                "peak_rss": statistics.median(
                    max(a["peak_rss_gb_per_rank"]) / max(b["peak_rss_gb_per_rank"])
                    for a, b in pairs
                ),
                "init_s": statistics.median(a["init_s"] / b["init_s"] for a, b in pairs),
                "pairs": len(pairs),
            }
            if all("init_cpu_s" in a and "init_cpu_s" in b for a, b in pairs):
                summary[plan][f"manualpar/{other}"]["init_cpu_s"] = statistics.median(
                    a["init_cpu_s"] / b["init_cpu_s"] for a, b in pairs
                )
            cpu = [(cpu_ms(a), cpu_ms(b)) for a, b in pairs]
            ratios = [ours / peer for ours, peer in cpu if ours and peer]
            if len(ratios) == len(pairs):  # CPU time: load-proof
                summary[plan][f"manualpar/{other}"]["cpu_ms_per_step"] = statistics.median(ratios)
        for mine, theirs in (
            ("batched", "torchrec"),
            ("local", "torchrec"),
            ("pipelined", "local"),
            ("pipelined", "torchrec"),
        ):
            if mine in by_name and theirs in by_name:  # the floor, the pipeline, the peer
                summary[plan][f"{mine}/{theirs}"] = {
                    "ms_per_step": statistics.median(
                        a["ms_per_step"] / b["ms_per_step"]
                        for a, b in zip(by_name[mine], by_name[theirs], strict=True)
                    )
                }
        summary[plan]["median_ms_per_step"] = {
            name: statistics.median(r["ms_per_step"] for r in results)
            for name, results in by_name.items()
        }
        floor_line = add_floor(summary[plan], floor[plan])
        peer = summary[plan].get("manualpar/torchrec", {})
        before = summary[plan].get("manualpar/manualpar" + job_launch.BASELINE, {})
        print(
            f"{plan}: "
            + (f"manualpar / TorchRec {peer['ms_per_step']:.3f}x; " if peer else "")
            + (f"in CPU time {peer['cpu_ms_per_step']:.3f}x; " if "cpu_ms_per_step" in peer else "")
            + (f"manualpar / --baseline-src {before['ms_per_step']:.3f}x; " if before else "")
            + (
                f"in CPU time {before['cpu_ms_per_step']:.3f}x; "
                if "cpu_ms_per_step" in before
                else ""
            )
            + floor_line,
            flush=True,
        )
    print(json.dumps(summary, indent=2))
    return {"summary": summary, "runs": runs}


def cpu_ms(result: dict) -> float | None:
    """A job's median CPU milliseconds per step (its busiest rank's, every thread of it;
    embedding_workload.STEP_CPU_MS), None from a worker that did not record it."""
    return result.get("cpu_ms_per_step")
