"""TorchRec's planner on manualpar's tables and topology: its plan as a manualpar plan JSON.

Runs from TorchRec's own environment (`make torchrec-peer` builds `.venv-torchrec`) and never
imports manualpar; compare_planners.py drives it, or run it alone:

    .venv-torchrec/bin/python examples/benchmarks/peer_torchrec_planner.py \\
        --tables examples/plans/criteo_1tb_tables.json --world-size 4 --ranks-per-node 4 \\
        --batch-per-rank 16384 --ids-per-bag 1 --topology topology.json --out torchrec_4.json

--topology is a JSON object with manualpar's Topology fields (`python -m manualpar calibrate`
writes one, Topology.to_json() another); the flags --hbm-cap, --ddr-cap, --hbm-bw, --intra-bw
and --inter-bw (bytes, bytes per second) override or replace it. The output loads with
EmbeddingPlan.from_json; its "torchrec" key holds what TorchRec's planner said: each table's
shards with their perf (ms) and storage estimates, per-rank sums, and the planning time.

The tables are declared on the meta device with a fused row-wise Adagrad attached before
planning (as peer_torchrec.py does: without it TorchRec plans DENSE kernels), and planned by
EmbeddingShardingPlanner.plan, which needs no process group. --score NAME=PLAN.json also prices
other plans (manualpar's) with TorchRec's shard estimators, rank by rank, for a like-for-like
comparison under TorchRec's own model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim import RowWiseAdagrad
from torchrec_plan_convert import to_manualpar_plan

# TorchRec's planner takes bandwidths in bytes per millisecond; manualpar's in bytes per second.
PER_MS = 1e-3
# manualpar's plan kinds -> TorchRec's, for --score
KINDS = {
    "table_wise": "table_wise",
    "row_wise": "row_wise",
    "table_row_wise": "table_row_wise",
    "column_wise": "column_wise",
    "data_parallel": "data_parallel",
}


def load_topology(args: argparse.Namespace) -> dict[str, float]:
    """hbm/ddr capacity (bytes) and bandwidths (bytes/s) from --topology, then the flags."""
    found: dict[str, float] = {}
    if args.topology:
        data = json.loads(Path(args.topology).read_text())
        found = {
            "hbm_cap": data["device_memory_bytes"],
            "ddr_cap": data["host_memory_bytes"],
            "hbm_bw": data["memory_bandwidth"],
            "intra_bw": data["intra_node_bandwidth"],
            "inter_bw": data["inter_node_bandwidth"],
        }
    for key in ("hbm_cap", "ddr_cap", "hbm_bw", "intra_bw", "inter_bw"):
        if getattr(args, key) is not None:
            found[key] = getattr(args, key)
    missing = [
        k for k in ("hbm_cap", "ddr_cap", "hbm_bw", "intra_bw", "inter_bw") if k not in found
    ]
    if missing:
        raise SystemExit(f"no topology numbers for {missing}: pass --topology FILE or the flags")
    return found


def torchrec_topology(args: argparse.Namespace, numbers: dict[str, float]) -> Topology:
    return Topology(
        world_size=args.world_size,
        compute_device="cuda",
        local_world_size=args.ranks_per_node,
        hbm_cap=int(numbers["hbm_cap"]),
        ddr_cap=int(numbers["ddr_cap"]),
        hbm_mem_bw=numbers["hbm_bw"] * PER_MS,
        intra_host_bw=numbers["intra_bw"] * PER_MS,
        inter_host_bw=numbers["inter_bw"] * PER_MS,
    )


def build_collection(tables: list[dict[str, Any]]) -> EmbeddingBagCollection:
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t["name"],
                num_embeddings=int(t["num_embeddings"]),
                embedding_dim=int(t["embedding_dim"]),
                feature_names=list(t.get("feature_names") or [t["name"]]),
                pooling=PoolingType.SUM,
            )
            for t in tables
        ],
        device=torch.device("meta"),
    )
    # Before planning: only parameters with an in-backward optimizer get FUSED kernels.
    _apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.01, "eps": 1e-8})
    return ebc


def describe(options: list[Any]) -> list[dict[str, Any]]:
    """TorchRec's sharding options (one per table, ranks assigned) as plain data."""
    described = []
    for option in options:
        shards = []
        for shard in option.shards:
            perf, storage = shard.perf, shard.storage
            shards.append(
                {
                    "rank": shard.rank,
                    "offset": list(shard.offset),
                    "size": list(shard.size),
                    "perf_ms": perf.total if perf is not None else None,
                    "hbm_bytes": storage.hbm if storage is not None else None,
                    "ddr_bytes": storage.ddr if storage is not None else None,
                }
            )
        described.append(
            {
                "name": option.name,
                "num_embeddings": int(option.tensor.shape[0]),
                "embedding_dim": int(option.tensor.shape[1]),
                "sharding_type": option.sharding_type,
                "compute_kernel": option.compute_kernel,
                "shards": shards,
            }
        )
    return described


def per_rank(described: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """TorchRec's estimates summed per rank: its NoopPerfModel rates a plan by the max perf."""
    perf, hbm = [0.0] * world, [0] * world
    for table in described:
        for shard in table["shards"]:
            perf[shard["rank"]] += shard["perf_ms"] or 0.0
            hbm[shard["rank"]] += shard["hbm_bytes"] or 0
    return {
        "perf_ms": perf,
        "hbm_bytes": hbm,
        "max_perf_ms": max(perf),
        "max_hbm_bytes": max(hbm),
    }


def score(
    plan: dict[str, Any],
    tables: list[dict[str, Any]],
    args: argparse.Namespace,
    topology: Topology,
) -> dict[str, Any]:
    """A manualpar plan priced by TorchRec's shard estimators: for each table, TorchRec's option
    of the same kind (and column count), its shards given the plan's ranks."""
    if plan["world_size"] != args.world_size:
        raise SystemExit(f"--score: plan for {plan['world_size']} ranks, not {args.world_size}")
    world = args.world_size
    options, unpriced = [], {}
    for table in tables:
        placement = plan["tables"][table["name"]]
        kind, ranks = placement["sharding"], list(placement.get("ranks") or [])
        constraint: dict[str, Any] = {
            "pooling_factors": [args.ids_per_bag],
            "sharding_types": [KINDS[kind]],
            "compute_kernels": ["dense" if kind == "data_parallel" else "fused"],
        }
        if kind == "column_wise":
            if table["embedding_dim"] % len(ranks):
                unpriced[table["name"]] = "columns do not split evenly over its ranks"
                continue
            constraint["min_partition"] = table["embedding_dim"] // len(ranks)
        enumerator = EmbeddingEnumerator(
            topology=topology,
            batch_size=args.batch_per_rank,
            constraints={table["name"]: ParameterConstraints(**constraint)},
        )
        found = [
            o
            for o in enumerator.enumerate(
                build_collection([table]), [EmbeddingBagCollectionSharder()]
            )
            if o.sharding_type == KINDS[kind]
        ]
        if not found:
            unpriced[table["name"]] = f"TorchRec offers no {kind} option"
            continue
        option = found[0]
        if kind == "data_parallel" or (kind == "row_wise" and not ranks):
            ranks = list(range(world))
        if len(option.shards) != len(ranks):
            unpriced[table["name"]] = (
                f"TorchRec's {kind} has {len(option.shards)} shards, the plan {len(ranks)} ranks"
            )
            continue
        for shard, rank in zip(option.shards, ranks, strict=True):
            shard.rank = rank
        options.append(option)
    return {**per_rank(describe(options), world), "unpriced": unpriced}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tables", required=True, help="JSON list of name/num_embeddings/embedding_dim"
    )
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--batch-per-rank", type=int, required=True)
    parser.add_argument(
        "--ids-per-bag",
        type=float,
        default=1.0,
        help="pooling factor (a table's own `ids_per_bag` field in --tables wins)",
    )
    parser.add_argument("--topology", help="JSON of manualpar's Topology fields")
    for flag in ("--hbm-cap", "--ddr-cap", "--hbm-bw", "--intra-bw", "--inter-bw"):
        parser.add_argument(flag, type=float, help="bytes (caps) or bytes per second")
    parser.add_argument(
        "--score",
        action="append",
        default=[],
        metavar="NAME=PLAN.json",
        help="also price this manualpar plan with TorchRec's estimators (repeat)",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.ranks_per_node = min(args.ranks_per_node, args.world_size)
    if args.world_size % args.ranks_per_node:
        raise SystemExit(f"--ranks-per-node {args.ranks_per_node} must divide --world-size")

    # The planner logs its search and warns about dry-run storage estimates on every call.
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning)
    tables = json.loads(Path(args.tables).read_text())
    numbers = load_topology(args)
    topology = torchrec_topology(args, numbers)
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=args.batch_per_rank,
        constraints={
            t["name"]: ParameterConstraints(
                pooling_factors=[float(t.get("ids_per_bag", args.ids_per_bag))]
            )
            for t in tables
        },
        debug=False,
    )
    module = build_collection(tables)
    started = time.perf_counter()
    planner.plan(module, [EmbeddingBagCollectionSharder()])
    seconds = time.perf_counter() - started
    described = describe(planner._best_plan)  # the chosen options, ranks assigned
    sizes = {t["name"]: t for t in tables}
    for table in described:  # the JSON's own names, in its order
        table["num_embeddings"] = int(sizes[table["name"]]["num_embeddings"])
    described.sort(key=lambda t: [x["name"] for x in tables].index(t["name"]))
    scored = {}
    for item in args.score:
        name, _, path = item.partition("=")
        scored[name] = score(json.loads(Path(path).read_text()), tables, args, topology)
    extra = {
        "torchrec": {
            "planner_seconds": seconds,
            "num_proposals": planner._num_proposals,
            "num_plans": planner._num_plans,
            "topology": {
                **numbers,
                "world_size": args.world_size,
                "ranks_per_node": args.ranks_per_node,
            },
            "batch_per_rank": args.batch_per_rank,
            "ids_per_bag": args.ids_per_bag,
            "per_rank": per_rank(described, args.world_size),
            "tables": described,
            "scored": scored,
        }
    }
    plan = to_manualpar_plan(args.world_size, args.ranks_per_node, described, extra)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(plan, indent=1))
    print(
        f"torchrec planned {len(described)} tables on {args.world_size} ranks in {seconds:.2f} s; "
        f"wrote {args.out}"
    )


if __name__ == "__main__":
    main()
