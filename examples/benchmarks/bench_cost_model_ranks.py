"""The cost model's per-rank step against the measured one at 8 ranks: 2 nodes x 4 processes.

    python examples/benchmarks/bench_cost_model_ranks.py --json runs/bench_cost_model_ranks.json

One collection (8 tables of 5k to 400k rows, 16 to 64 wide, 1 to 16 ids a bag; row-wise
Adagrad; uniform ids) is placed several ways on 8 ranks: the planner's pick, table-wise,
row-wise, column-wise, row-wise within a node, the memory-only placement, and every table on
rank 0 (a placement made to be imbalanced). This process:

1. calibrates a topology for this machine: the `cpu-host` preset for 8 ranks, 4 to a node, and
   one core a node (the two nodes share this machine's cores), its compute rates (memory
   bandwidth, cost per row and per block) scaled by the measured CPU time / predicted time of
   a single-process step of the whole job's work (every table in one process, the global
   batch), run before and after the job (geometric mean). CPU time, since on a shared machine
   that process's wall clock follows the load; the preset's link figures are kept (the links
   are also re-measured now, as `calibrate` does, and priced as `links_now` for comparison);
2. starts two torchrun agents on this machine (one a node, a c10d rendezvous on 127.0.0.1), whose
   8 ranks train every placement on the same batches, in rotating order per repeat, recording
   each rank's per-phase seconds (`emb.phase_times`) and process CPU time of every step;
3. prints and writes, per placement, the predicted per-rank seconds (`plan_costs(...).seconds`)
   against each rank's measured step (the sum of its phases, median over steps): the slowest
   rank predicted against measured, the plans' rank order both ways (Spearman), and the slowest
   rank against the median rank, predicted without core sharing against measured CPU time.
   Also priced on `host`, the same rates as one node of 8 ranks sharing all the cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import cycling_step, median, write_json
from ranks_job import (
    FIELDS,
    PHASES,
    add_workload_args,
    configs,
    features,
    per_bag,
    rank_batch,
    run_job,
    workload,
)

import manualpar as mp
from manualpar.cli.calibrate import measure_links
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingPlan,
    RowWiseAdagrad,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.planning import (
    Topology,
    load_topology,
    plan_costs,
    plan_tables,
    plan_uniform,
)
from manualpar.phase_times import LOOKUP, UPDATE

PICK = "auto (the pick)"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--nodes", type=int, default=2)
    add("--nproc-per-node", type=int, default=4)
    add_workload_args(parser)
    add("--timeout", type=float, default=900, help="seconds the 8-rank job may take")
    add("--json")
    return parser.parse_args()


# ---- calibration: one process, the whole job's work ---------------------------------------------


def single_process_seconds(args: argparse.Namespace, world: int) -> dict[str, float]:
    """Median wall and CPU seconds of a step of every table in this one process on the global
    batch (the ids of all `world` ranks' batches of each step, concatenated)."""
    tables = configs(args)
    local = args.batch // world
    data = []
    for index in range(args.warmup + args.steps):
        per_rank = [rank_batch(tables, r, local, index) for r in range(world)]
        merged = [torch.cat([ids[t] for ids in per_rank]) for t in range(len(tables))]
        data.append(features(tables, merged, local * world))
    strategy = mp.ManualParallelStrategy()
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables, seed=0)
    plan = {t.name: table_wise(0) for t in tables}
    step = cycling_step(shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.01)), data)
    for _ in range(args.warmup):
        step()
    walls, cpus = [], []
    for _ in range(args.steps):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    strategy.teardown()
    return {"wall": median(walls), "cpu": median(cpus)}


def single_process_predicted(args: argparse.Namespace) -> float:
    """The model's seconds for the same single-process step (no links at world 1)."""
    tables = configs(args)
    one = load_topology("cpu-host", 1, 1)
    plan = EmbeddingPlan(1, {t.name: table_wise(0) for t in tables})
    costs = plan_costs(tables, plan, one, workload(args.batch))
    return float(costs.seconds(one, latency=False)[0])


def job_topology(args: argparse.Namespace, scale: float) -> Topology:
    """The `cpu-host` preset for this job (nodes x ranks a node, the machine's cores split
    evenly over its nodes), its compute rates `scale` times slower."""
    world = args.nodes * args.nproc_per_node
    base = load_topology("cpu-host", world, args.nproc_per_node)
    return dataclasses.replace(
        base,
        name=f"cpu-host x{scale:.2f}",
        cores_per_node=max((os.cpu_count() or 1) // args.nodes, 1),
        memory_bandwidth=base.memory_bandwidth / scale,
        row_seconds=base.row_seconds * scale,
        block_seconds=base.block_seconds * scale,
    )


def topologies(
    args: argparse.Namespace, scale: float, link: float, latency: float
) -> dict[str, Topology]:
    """The job as planned (`job`), the same rates as the one host it runs on (`host`: all
    ranks one node sharing every core; links are equal either way), the job with the links
    measured now (`links_now`), and the uncalibrated preset (`preset`)."""
    job = job_topology(args, scale)
    host = dataclasses.replace(
        job.with_world(job.world_size, job.world_size), cores_per_node=os.cpu_count() or 1
    )
    now = dataclasses.replace(
        job,
        intra_node_bandwidth=link,
        inter_node_bandwidth=link,
        intra_node_latency=latency,
        inter_node_latency=latency,
    )
    return {"job": job, "host": host, "links_now": now, "preset": job_topology(args, 1.0)}


def candidate_plans(args: argparse.Namespace, topology: Topology) -> dict[str, EmbeddingPlan]:
    tables, world, per_node = configs(args), topology.world_size, topology.ranks_per_node
    common: dict[str, Any] = {
        "ranks_per_node": per_node,
        "optimizer": RowWiseAdagrad(lr=0.01),
        "pooling_factors": per_bag(),
    }
    plans = {
        PICK: plan_tables(
            tables, world, topology=topology, batch_per_rank=args.batch // world, **common
        ),
        "memory": plan_tables(tables, world, price="memory", **common),
    }
    for kind in ("table_wise", "row_wise", "column_wise", "table_row_wise"):
        plans[kind] = plan_uniform(kind, tables, world, ranks_per_node=per_node)
    plans["all on rank 0"] = EmbeddingPlan(world, {t.name: table_wise(0) for t in tables})
    return plans


# ---- predicted against measured ------------------------------------------------------------------


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties share their mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for position, i in enumerate(order):
            tied = [j for j in order if values[j] == values[i]]
            out[i] = position if len(tied) == 1 else sum(order.index(j) for j in tied) / len(tied)
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else float("nan")


def per_rank_ms(runs: list[Any], pick: Callable[[list[float]], float]) -> list[float]:
    """Each rank's median over repeats of its median over steps of `pick(fields)`, in ms."""
    return [
        1000 * median([median([pick(step) for step in repeat[r]]) for repeat in runs])
        for r in range(len(runs[0]))
    ]


def skew(values: list[float]) -> float:
    """The slowest rank against the median rank."""
    return max(values) / median(values)


def measured_ranks(runs: list[Any]) -> dict[str, Any]:
    """Per rank: the step (the sum of its phases), wall clock, CPU time and each phase, ms."""
    at = {name: FIELDS.index(name) for name in FIELDS}

    def field(name: str) -> list[float]:
        return per_rank_ms(runs, lambda f: f[at[name]])

    phases = {p: field(p) for p in PHASES}
    return {
        "step_ms": per_rank_ms(runs, lambda f: sum(f[at[p]] for p in PHASES)),
        "wall_ms": field("wall"),
        "cpu_ms": field("cpu"),
        "phase_ms": phases,
        "lookup_update_ms": [a + b for a, b in zip(phases[LOOKUP], phases[UPDATE], strict=True)],
    }


def compare(
    args: argparse.Namespace,
    plans: dict[str, EmbeddingPlan],
    runs: dict[str, Any],
    named: dict[str, Topology],
) -> dict[str, dict[str, Any]]:
    """Per plan: the measured ranks, and per topology the predicted per-rank ms and the
    slowest rank's predicted / measured; the skews (slowest / median rank) both ways."""
    tables, job = configs(args), named["job"]
    load = workload(args.batch // job.world_size)
    own = dataclasses.replace(job, cores_per_node=0)  # each rank's own work, unshared
    out = {}
    for name, plan in plans.items():
        measured = measured_ranks(runs[name])
        slowest = max(measured["step_ms"])
        row: dict[str, Any] = {"measured": measured, "slowest_measured_ms": slowest}
        for key, topology in named.items():
            costs = plan_costs(tables, plan, topology, load)
            predicted = (1000 * costs.seconds(topology)).tolist()
            row[key] = {"predicted_ms": predicted, "error": max(predicted) / slowest}
        row["predicted_own_ms"] = (1000 * plan_costs(tables, plan, own, load).seconds(own)).tolist()
        row["skew"] = {
            "step_predicted": skew(row["job"]["predicted_ms"]),
            "step_measured": skew(measured["step_ms"]),
            "own_predicted": skew(row["predicted_own_ms"]),
            "cpu_measured": skew(measured["cpu_ms"]),
        }
        # the slowest rank against the machine's CPU time over its cores: what waits and other
        # processes on the machine add to the step
        row["step_over_cpu_per_core"] = slowest / (sum(measured["cpu_ms"]) / (os.cpu_count() or 1))
        out[name] = row
    return out


def orders(rows: dict[str, dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    names = list(rows)
    measured = [rows[n]["slowest_measured_ms"] for n in names]
    result: dict[str, Any] = {
        "measured": sorted(names, key=lambda n: rows[n]["slowest_measured_ms"])
    }
    for key in keys:
        predicted = [max(rows[n][key]["predicted_ms"]) for n in names]
        result[key] = sorted(names, key=lambda n: max(rows[n][key]["predicted_ms"]))
        result[f"spearman_{key}"] = spearman(predicted, measured)
    return result


def report(rows: dict[str, dict[str, Any]], order: dict[str, Any], calibration: dict) -> None:
    c = calibration
    print(
        f"calibration: one process {c['single_cpu_ms']:.1f} ms CPU a step "
        f"({c['single_wall_ms']:.1f} ms wall) against {c['single_predicted_ms']:.1f} ms "
        "predicted: compute x"
        f"{c['compute_scale']:.2f}; links now {c['link_gb_per_s']:.2f} GB/s, "
        f"{c['latency_us']:.0f} us a call (preset {c['preset_link_gb_per_s']:.2f} GB/s, "
        f"{c['preset_latency_us']:.0f} us)"
    )
    print(
        f"{'plan':<16} {'measured':>8} {'job':>15} {'host':>15} {'links now':>15}  "
        "slowest/median: step, own work/CPU  step/(CPU/cores)"
    )
    for n in order["measured"]:
        r, s = rows[n], rows[n]["skew"]
        cells = " ".join(
            f"{max(r[k]['predicted_ms']):>7.1f} {r[k]['error']:>5.2f}x"
            for k in ("job", "host", "links_now")
        )
        print(
            f"{n:<16} {r['slowest_measured_ms']:>6.1f}ms {cells}  {s['step_predicted']:.2f}/"
            f"{s['step_measured']:.2f}, {s['own_predicted']:.2f}/{s['cpu_measured']:.2f}  "
            f"{r['step_over_cpu_per_core']:.2f}"
        )
    for key in ("measured", "job", "host"):
        spear = f" (Spearman {order[f'spearman_{key}']:.2f})" if key != "measured" else ""
        print(f"order {key}: {', '.join(order[key])}{spear}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    world = args.nodes * args.nproc_per_node
    predicted_one = single_process_predicted(args)
    before = single_process_seconds(args, world)
    link, latency = measure_links(64 * 2**20, 5)
    planned_on = job_topology(args, before["cpu"] / predicted_one)
    plans = candidate_plans(args, planned_on)
    print(f"{world} ranks ({args.nodes} nodes x {args.nproc_per_node}): {', '.join(plans)}")
    with tempfile.TemporaryDirectory(prefix="bench_cost_model_ranks_") as folder:
        measured = run_job(args, plans, Path(folder))
    after = single_process_seconds(args, world)
    cpu = math.sqrt(before["cpu"] * after["cpu"])  # the scale is that of the mean of both runs
    preset = load_topology("cpu-host", 1)
    calibration = {
        "single_cpu_ms": 1000 * cpu,
        "single_wall_ms": 1000 * math.sqrt(before["wall"] * after["wall"]),
        "single_runs": {"before": before, "after": after},
        "single_predicted_ms": 1000 * predicted_one,
        "compute_scale": cpu / predicted_one,
        "link_gb_per_s": link / 1e9,
        "latency_us": latency * 1e6,
        "preset_link_gb_per_s": preset.intra_node_bandwidth / 1e9,
        "preset_latency_us": preset.intra_node_latency * 1e6,
    }
    named = topologies(args, cpu / predicted_one, link, latency)
    rows = compare(args, plans, measured["runs"], named)
    order = orders(rows, list(named))
    report(rows, order, calibration)
    write_json(
        args.json,
        {
            "args": vars(args),
            "calibration": calibration,
            "topologies": {k: t.to_dict() for k, t in named.items()},
            "planned_on": planned_on.to_dict(),
            "plans": {n: p.to_dict() for n, p in plans.items()},
            "results": rows,
            "order": order,
            "job": measured["job"],
            "runs": measured["runs"],
            "torch": str(torch.__version__),
        },
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
