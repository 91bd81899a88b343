"""manualpar's planner next to TorchRec's: the same tables, topology and workload, per world size.

    PYTHONPATH=. .venv/bin/python examples/benchmarks/compare_planners.py \\
        --tables examples/plans/criteo_1tb_tables.json --topology a100-nvlink-hdr \\
        --world-sizes 8 64 512 --global-batch 65536 --ids-per-bag 1 \\
        --peer-python .venv-torchrec/bin/python --out runs/compare_planners.json

For each world size: manualpar's plan_tables (price "time" and "memory", named "cost" and
"memory" in the output) and TorchRec's EmbeddingShardingPlanner (peer_torchrec_planner.py in
TorchRec's environment, `make torchrec-peer`), each plan then priced by both models:
manualpar's cost model (predicted slowest rank, bytes sent per rank on and across nodes, memory
per rank) and TorchRec's shard estimators (its perf in ms and HBM per rank, as its planner rates
plans). Nothing runs a step: these are predictions, for datasheet hardware. Without
--peer-python only manualpar's plans are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from manualpar.embeddings import EmbeddingBagConfig, EmbeddingPlan, RowWiseAdagrad
from manualpar.embeddings.planning import (
    Workload,
    format_bytes,
    format_seconds,
    load_topology,
    plan_costs,
    plan_tables,
    rule_costs,
)

HERE = Path(__file__).resolve().parent
PEER = HERE / "peer_torchrec_planner.py"
BIGGEST = 5  # tables whose placements are printed
RULE = RowWiseAdagrad(lr=0.01)  # TorchRec's peer uses the same rule: its state counts


def load_tables(path: str) -> list[EmbeddingBagConfig]:
    entries = json.loads(Path(path).read_text())
    return [
        EmbeddingBagConfig(e["name"], int(e["num_embeddings"]), int(e["embedding_dim"]))
        for e in entries
    ]


def summary(
    plan: EmbeddingPlan,
    tables: list[EmbeddingBagConfig],
    topology: Any,
    workload: Workload,
) -> dict[str, Any]:
    """A plan by manualpar's cost model: kinds, biggest tables, slowest rank, bytes, memory."""
    plan.validate(tables, topology.world_size)
    costs = plan_costs(tables, plan, topology, workload)
    seconds = costs.seconds(topology)
    biggest = sorted(tables, key=lambda c: -c.num_embeddings * c.embedding_dim)[:BIGGEST]
    return {
        "kinds": dict(Counter(p.sharding for p in plan.tables.values())),
        "biggest": {c.name: str(plan.tables[c.name]) for c in biggest},
        "slowest_rank_s": float(seconds.max()),
        "median_rank_s": float(seconds.median()),
        "sent_intra_max": float(costs.sent_intra.max()),
        "sent_intra_median": float(costs.sent_intra.median()),
        "sent_inter_max": float(costs.sent_inter.max()),
        "sent_inter_median": float(costs.sent_inter.median()),
        "memory_max": float(costs.memory.max()),
        "memory_median": float(costs.memory.median()),
    }


def run_peer(
    args: argparse.Namespace,
    world: int,
    per_node: int,
    batch: int,
    topology: Any,
    plans: dict[str, EmbeddingPlan],
    scratch: Path,
) -> dict[str, Any]:
    """TorchRec's plan (and its prices of `plans`) from peer_torchrec_planner.py."""
    topo_file = scratch / f"topology_{world}.json"
    topo_file.write_text(topology.to_json())
    command = [
        args.peer_python,
        str(PEER),
        *("--tables", args.tables, "--world-size", str(world)),
        *("--ranks-per-node", str(per_node), "--batch-per-rank", str(batch)),
        *("--ids-per-bag", str(args.ids_per_bag), "--topology", str(topo_file)),
    ]
    for name, plan in plans.items():
        path = scratch / f"manualpar_{name}_{world}.json"
        path.write_text(plan.to_json())
        command += ["--score", f"{name}={path}"]
    out = scratch / f"torchrec_{world}.json"
    command += ["--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the peer never imports manualpar
    started = time.perf_counter()
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if run.returncode or not out.exists():
        raise SystemExit(
            f"TorchRec's planner failed ({' '.join(command)}), exit {run.returncode}:\n"
            + run.stderr[-3000:]
        )
    result = json.loads(out.read_text())
    result["torchrec"]["process_seconds"] = time.perf_counter() - started
    if args.keep_plans:
        keep = Path(args.keep_plans)
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"torchrec_{world}.json").write_text(json.dumps(result, indent=1))
        for name, plan in plans.items():
            (keep / f"manualpar_{name}_{world}.json").write_text(plan.to_json())
    return result


def workload_of(tables: list[EmbeddingBagConfig], batch: int, ids_per_bag: float) -> Workload:
    """The step every plan is priced for: `batch` samples a rank, `ids_per_bag` ids a bag,
    RULE's state (tests/unit/test_docs_planning_peer.py prices the stored plans with it)."""
    state, full_rows = rule_costs(RULE)
    pooling = {c.name: ids_per_bag for c in tables}
    return Workload(batch, pooling, state=state, full_rows=full_rows)


def compare_world(args: argparse.Namespace, world: int, scratch: Path) -> dict[str, Any]:
    tables = load_tables(args.tables)
    per_node = min(args.ranks_per_node, world)
    topology = load_topology(args.topology, world, per_node)
    batch = args.batch_per_rank or max(1, args.global_batch // world)
    pooling = {c.name: args.ids_per_bag for c in tables}
    workload = workload_of(tables, batch, args.ids_per_bag)
    plans: dict[str, EmbeddingPlan] = {}
    planners: dict[str, dict[str, Any]] = {}
    for method, price in (("cost", "time"), ("memory", "memory")):
        started = time.perf_counter()
        plans[method] = plan_tables(
            tables,
            world,
            ranks_per_node=per_node,
            memory_budget_bytes=topology.device_memory_bytes,
            rule=RULE,
            pooling_factors=pooling,
            price=price,
            topology=topology,
            batch_per_rank=batch,
        )
        planners[f"manualpar {method}"] = {"planner_seconds": time.perf_counter() - started}
    if args.peer_python:
        peer = run_peer(args, world, per_node, batch, topology, plans, scratch)
        torchrec = peer.pop("torchrec")
        plans["torchrec"] = EmbeddingPlan.from_dict(peer)
        planners["torchrec"] = {
            "planner_seconds": torchrec["planner_seconds"],
            "process_seconds": torchrec["process_seconds"],
            "torchrec_max_perf_ms": torchrec["per_rank"]["max_perf_ms"],
            "torchrec_max_hbm": torchrec["per_rank"]["max_hbm_bytes"],
            "approximate": {n: t for n, t in peer["notes"].items() if t.startswith("approx")},
            "num_proposals": torchrec["num_proposals"],
        }
        for method in ("cost", "memory"):
            priced = torchrec["scored"][method]
            planners[f"manualpar {method}"] |= {
                "torchrec_max_perf_ms": priced["max_perf_ms"],
                "torchrec_max_hbm": priced["max_hbm_bytes"],
                "torchrec_unpriced": priced["unpriced"],
            }
    for name, plan in zip(planners, plans.values(), strict=True):
        planners[name] |= summary(plan, tables, topology, workload)
        planners[name]["plan"] = plan.to_dict()
    return {
        "world_size": world,
        "ranks_per_node": per_node,
        "batch_per_rank": batch,
        "ids_per_bag": args.ids_per_bag,
        "topology": args.topology,
        "planners": planners,
    }


ROWS = (
    ("placements", lambda s: ", ".join(f"{k} {v}" for k, v in sorted(s["kinds"].items()))),
    ("slowest rank (manualpar model)", lambda s: format_seconds(s["slowest_rank_s"])),
    ("sent on node, max / median", lambda s: _pair(s, "sent_intra")),
    ("sent across nodes, max / median", lambda s: _pair(s, "sent_inter")),
    ("memory max / median", lambda s: _pair(s, "memory")),
    ("TorchRec perf, slowest rank", lambda s: _ms(s.get("torchrec_max_perf_ms")) + _unpriced(s)),
    ("TorchRec HBM, fullest rank", lambda s: _bytes(s.get("torchrec_max_hbm")) + _unpriced(s)),
    ("planning time", lambda s: f"{s['planner_seconds']:.2f} s"),
)


def _pair(s: dict[str, Any], key: str) -> str:
    return f"{format_bytes(s[f'{key}_max'])} / {format_bytes(s[f'{key}_median'])}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def _bytes(value: float | None) -> str:
    return "-" if value is None else format_bytes(value)


def _unpriced(s: dict[str, Any]) -> str:
    """How many of the plan's tables TorchRec's estimators left out (a split they have no
    shards for): its numbers then cover the others only."""
    unpriced = len(s.get("torchrec_unpriced", {}))
    return f" ({unpriced} of {sum(s['kinds'].values())} tables not priced)" if unpriced else ""


def _only_boundaries(note: str) -> bool:
    reasons = note.split("; ")[1:]
    return bool(reasons) and all(" blocks of " in reason for reason in reasons)


def table_text(result: dict[str, Any]) -> str:
    planners = result["planners"]
    width = max(24, *(len(f(s)) for s in planners.values() for _, f in ROWS))
    lines = [
        f"{result['world_size']} ranks ({result['ranks_per_node']} a node, {result['topology']}), "
        f"{result['batch_per_rank']} samples a rank, {result['ids_per_bag']:g} ids per bag",
        f"  {'':<32}" + "".join(f"{name:<{width + 2}}" for name in planners),
    ]
    for label, value in ROWS:
        lines.append(
            f"  {label:<32}" + "".join(f"{value(s):<{width + 2}}" for s in planners.values())
        )
    first = next(iter(planners.values()))
    for table in first["biggest"]:
        cells = "".join(f"{s['biggest'][table]:<{width + 2}}" for s in planners.values())
        lines.append(f"  {table:<32}{cells}")
    for name, s in planners.items():
        approximate = s.get("approximate", {})
        # TorchRec's row blocks are ceil-sized, manualpar's even: a few rows' difference, only
        # counted; other approximations are printed
        boundaries = [t for t, note in approximate.items() if _only_boundaries(note)]
        if boundaries:
            lines.append(
                f"  ({name}: {len(boundaries)} tables' row blocks differ from manualpar's even "
                "split by a few rows; the JSON's notes say by how much)"
            )
        for table, note in approximate.items():
            if table not in boundaries:
                lines.append(f"  ({name} {table}: {note})")
        for table, why in s.get("torchrec_unpriced", {}).items():
            lines.append(f"  ({name} {table}: not priced by TorchRec: {why})")
    return "\n".join(lines)


def table_markdown(result: dict[str, Any]) -> str:
    """The same comparison as a markdown table (what docs/planning-peer.md shows)."""
    planners = result["planners"]
    lines = [
        f"**{result['world_size']} ranks** ({result['batch_per_rank']} samples a rank)",
        "",
        "| | " + " | ".join(planners) + " |",
        "|---|" + "---|" * len(planners),
    ]
    for label, value in ROWS:
        lines.append(f"| {label} | " + " | ".join(value(s) for s in planners.values()) + " |")
    first = next(iter(planners.values()))
    for table in first["biggest"]:
        cells = " | ".join(f"`{s['biggest'][table]}`" for s in planners.values())
        lines.append(f"| {table} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", default=str(HERE.parent / "plans" / "criteo_1tb_tables.json"))
    parser.add_argument("--topology", default="a100-nvlink-hdr", help="a preset or a JSON file")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=65536, help="split over the ranks")
    parser.add_argument("--batch-per-rank", type=int, help="instead of --global-batch")
    parser.add_argument("--ids-per-bag", type=float, default=1.0)
    parser.add_argument("--peer-python", help="python of the venv with torchrec (.venv-torchrec)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per TorchRec plan")
    parser.add_argument("--keep-plans", metavar="DIR", help="also write every plan's JSON here")
    parser.add_argument("--out", help="write the comparison's JSON here")
    parser.add_argument("--markdown", help="also write the tables as markdown here")
    args = parser.parse_args()
    if args.peer_python and not Path(args.peer_python).exists():
        raise SystemExit(
            f"--peer-python {args.peer_python} does not exist: `make torchrec-peer` builds "
            ".venv-torchrec (or leave --peer-python out to compare manualpar's methods only)"
        )
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for world in args.world_sizes:
            result = compare_world(args, world, Path(scratch))
            print(table_text(result), flush=True)
            results.append(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        print(f"wrote {args.out}")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text("\n".join(table_markdown(r) for r in results))
        print(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
