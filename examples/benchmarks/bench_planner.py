"""The planner's pick against the other plans it weighed, measured: step time, predicted vs real.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \
        examples/benchmarks/bench_planner.py --ids uniform --json runs/bench_planner.json

One recommender-like collection (tables of 1k to 2M rows, 16 to 64 wide, 1 to 20 ids a bag) is
planned by plan="auto" (the cost model on --topology) and compared with the plans it ranked
below its pick: each table's runner-up alone (the notes say which), the memory-only placement
(price="memory"), and table-, row- and column-wise for every table. Every variant trains the
same batches (uniform or Zipf(1.05) ids, rank r's from a seed of its own) with row-wise Adagrad,
in the same processes; repeats run the variants in rotating order, each timing --steps steps
(the slowest rank's, median). Printed and written per variant: the median step time, its ratio
to the planner's pick, and the model's predicted slowest rank for the same plan.

With --mesh RxS the job runs as a R x S mesh: every plan is for the shard dim, and the pick is
the planner's for R replicas. --extra-plan NAME=FILE adds a plan from a file (another planner's,
e.g. TorchRec's converted by peer_torchrec_planner.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import cycling_step, environment_info, median, time_steps, write_json
from bench_disk_tier import zipf_ids

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    TablePlacement,
    column_wise,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.planning import (
    Workload,
    load_topology,
    plan_by_cost,
    plan_costs,
    plan_tables,
    plan_uniform,
    rule_costs,
)

ZIPF = 1.05  # the exponent of --ids zipf
# (rows, dim, ids a bag): a few large hot tables, mid-sized ones, small ones
TABLES = [
    (2_000_000, 64, 10),
    (1_000_000, 64, 20),
    (500_000, 32, 5),
    (200_000, 32, 10),
    (100_000, 64, 1),
    (50_000, 16, 2),
    (20_000, 32, 5),
    (10_000, 16, 1),
    (5_000, 64, 3),
    (1_000, 16, 1),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ids", choices=("uniform", "zipf"), default="uniform")
    parser.add_argument("--batch", type=int, default=2048, help="global batch (all ranks)")
    parser.add_argument("--mesh", default=None, metavar="RxS", help="a 2-D mesh, e.g. 2x2")
    parser.add_argument("--topology", default="cpu-host", help="preset or calibrated file")
    parser.add_argument(
        "--row-scale", type=float, default=1.0, help="scale every table's rows (toy runs)"
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--write-tables",
        metavar="FILE",
        help="write the tables (with each one's ids_per_bag) as JSON for another planner, and exit",
    )
    parser.add_argument(
        "--extra-plan",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="also run a plan from a JSON file (EmbeddingPlan.to_json), e.g. another planner's",
    )
    parser.add_argument("--json")
    return parser.parse_args()


def table_rows(args: argparse.Namespace) -> list[int]:
    return [max(int(rows * args.row_scale), 64) for rows, _, _ in TABLES]


def configs(args: argparse.Namespace) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(f"t{i}", rows, dim)
        for i, (rows, (_, dim, _)) in enumerate(zip(table_rows(args), TABLES, strict=True))
    ]


def per_bag() -> dict[str, float]:
    return {f"t{i}": float(k) for i, (_, _, k) in enumerate(TABLES)}


def batches(args: argparse.Namespace, rank: int, local: int, count: int) -> list[SparseFeatures]:
    keys = tuple(f"t{i}" for i in range(len(TABLES)))
    out = []
    for step in range(count):
        values, lengths = [], []
        for i, (rows, (_, _, k)) in enumerate(zip(table_rows(args), TABLES, strict=True)):
            seed = 1_000_003 * rank + 7919 * step + i
            if args.ids == "zipf":
                drawn = zipf_ids(rows, local * k, seed, ZIPF)
            else:
                drawn = torch.randint(
                    0, rows, (local * k,), generator=torch.Generator().manual_seed(seed)
                )
            values.append(drawn)
            lengths.append(torch.full((local,), k, dtype=torch.int64))
        out.append(SparseFeatures(keys, torch.cat(values), torch.cat(lengths)))
    return out


def candidates(
    tables: list[EmbeddingBagConfig], shards: int, replicas: int, topology: Any, workload: Workload
) -> dict[str, EmbeddingPlan]:
    """The planner's pick first, then the plans it ranked lower."""
    named = {t.name: t for t in tables}
    picked = plan_by_cost(named, topology, workload, replicas=replicas)
    plans = {"auto": picked.plan}
    costliest = sorted(picked.table_seconds, key=lambda k: -picked.table_seconds[k])
    for name in costliest[:2]:  # the two costliest tables, each moved to its runner-up
        runner = _runner_up(picked.plan.notes[name], shards)
        if runner is not None:
            moved = dict(picked.plan.tables) | {name: runner}
            plans[f"{name} -> {runner}"] = EmbeddingPlan(shards, moved)
    per_node = min(topology.ranks_per_node, shards)
    plans["memory"] = plan_tables(
        tables, shards, price="memory", ranks_per_node=per_node, pooling_factors=per_bag()
    )
    for kind in ("table_wise", "row_wise"):
        plans[kind] = plan_uniform(kind, tables, shards)
    plans["column_wise"] = EmbeddingPlan(
        shards, {t.name: column_wise(range(shards)) for t in tables}
    )
    return plans


def _runner_up(note: str, shards: int) -> TablePlacement | None:
    """The placement a note names as runner-up ("runner-up table_wise[2]: ...")."""
    if "runner-up " not in note:
        return None
    text = note.split("runner-up ", 1)[1].split(":", 1)[0]
    kind, _, ranks = text.partition("[")
    numbers = [int(r) for r in ranks.rstrip("]").split(",") if r.strip()]
    if kind == "table_wise":
        return table_wise(numbers[0])
    if kind == "row_wise":
        return row_wise()
    if kind == "column_wise":
        return column_wise(numbers)
    if kind == "table_row_wise":
        return TablePlacement("table_row_wise", tuple(numbers))
    return TablePlacement(kind)


def main() -> None:
    args = parse_args()
    if args.write_tables:
        entries = [
            {"name": c.name, "num_embeddings": c.num_embeddings, "embedding_dim": c.embedding_dim}
            | {"ids_per_bag": per_bag()[c.name]}
            for c in configs(args)
        ]
        Path(args.write_tables).write_text(json.dumps(entries, indent=1) + "\n")
        return
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    world = strategy.world_size
    replicas, shards = (int(x) for x in args.mesh.split("x")) if args.mesh else (1, world)
    mesh = strategy.mesh(replicate=replicas, shard=shards) if args.mesh else None
    per_node = strategy.environment.local_world_size
    topology = load_topology(args.topology, world, per_node)
    tables = configs(args)
    local = args.batch // world
    state, full_rows = rule_costs(RowWiseAdagrad(lr=0.01))
    skew = ZIPF if args.ids == "zipf" else 0.0  # the planner is told how popular ids are
    workload = Workload(local, per_bag(), state=state, full_rows=full_rows, skew=skew)
    plans = candidates(tables, shards, replicas, topology, workload)
    for extra in args.extra_plan:
        name, _, path = extra.partition("=")
        plans[name] = EmbeddingPlan.from_json(Path(path).read_text())
    data = batches(args, strategy.rank, local, args.warmup + args.steps)
    steps: dict[str, Callable[[], None]] = {}
    for name, plan in plans.items():
        with mp.empty_init():
            ebc = EmbeddingBagCollection(tables, seed=0)
        emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.01), mesh=mesh)
        steps[name] = cycling_step(emb, data)
    names = list(plans)
    repeats = []
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        times = {n: median(time_steps(strategy, steps[n], args.steps, args.warmup)) for n in order}
        repeats.append({n: 1000 * times[n] for n in names})
    measured = {n: median([r[n] for r in repeats]) for n in names}
    predicted = {
        n: 1000
        * float(
            plan_costs(tables, p, topology, workload, replicas=replicas).seconds(topology).max()
        )
        for n, p in plans.items()
    }
    result = {
        "args": vars(args),
        "plans": {n: p.to_dict() for n, p in plans.items()},
        "repeats_ms": repeats,
        "measured_ms": measured,
        "ratio_to_pick": {n: measured[n] / measured["auto"] for n in names},
        "predicted_ms": predicted,
        "environment": environment_info(strategy),
    }
    if strategy.is_global_zero:
        print(f"{args.ids} ids, {world} processes{f' as {args.mesh}' if args.mesh else ''}:")
        print(f"  {'plan':<34} {'measured':>10} {'vs pick':>8} {'predicted':>10}")
        for n in sorted(names, key=lambda n: measured[n]):
            print(
                f"  {n:<34} {measured[n]:>8.1f}ms {measured[n] / measured['auto']:>7.2f}x "
                f"{predicted[n]:>8.2f}ms"
            )
        write_json(args.json, result)
    strategy.teardown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
