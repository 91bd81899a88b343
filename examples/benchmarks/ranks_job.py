"""The workload of bench_cost_model_ranks.py and its multi-node job on this machine.

    python -m torch.distributed.run ... ranks_job.py --plans PLANS.json --result OUT.json

`run_job` starts one torchrun agent a node (a c10d rendezvous on 127.0.0.1), each running this
file as the worker: its ranks build every plan of PLANS.json over the same tables, train them
on the same batches in rotating order per repeat, and record each rank's seconds per step
(wall clock, process CPU time, and each phase of `emb.phase_times`); rank 0 writes them all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import cycling_step

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    shard_embeddings,
)
from manualpar.embeddings.planning import Workload, rule_costs
from manualpar.phase_times import (
    GRAD_EXCHANGE,
    IDS_EXCHANGE,
    LOOKUP,
    POOLED_EXCHANGE,
    UPDATE,
)
from manualpar.testing import free_port

PHASES = (IDS_EXCHANGE, LOOKUP, POOLED_EXCHANGE, GRAD_EXCHANGE, UPDATE)
FIELDS = ("wall", "cpu", *PHASES)  # what each rank records per step, seconds
# (rows, dim, ids a bag): dims divide by 8, so column-wise splits every table over all ranks
TABLES = [
    (400_000, 64, 8),
    (200_000, 64, 16),
    (200_000, 32, 4),
    (100_000, 32, 8),
    (50_000, 64, 2),
    (20_000, 16, 4),
    (10_000, 32, 1),
    (5_000, 16, 2),
]


def configs(args: argparse.Namespace) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(f"t{i}", max(int(rows * args.row_scale), 64), dim)
        for i, (rows, dim, _) in enumerate(TABLES)
    ]


def per_bag() -> dict[str, float]:
    return {f"t{i}": float(k) for i, (_, _, k) in enumerate(TABLES)}


def workload(batch_per_rank: int) -> Workload:
    state, full_rows = rule_costs(RowWiseAdagrad(lr=0.01))
    return Workload(batch_per_rank, per_bag(), state=state, full_rows=full_rows)


def rank_batch(
    tables: list[EmbeddingBagConfig], rank: int, local: int, step: int
) -> list[torch.Tensor]:
    """Rank `rank`'s ids of step `step`, one tensor a table (`local` bags of its ids a bag)."""
    out = []
    for i, (config, k) in enumerate(zip(tables, per_bag().values(), strict=True)):
        seed = 1_000_003 * rank + 7919 * step + i
        generator = torch.Generator().manual_seed(seed)
        out.append(torch.randint(0, config.num_embeddings, (local * int(k),), generator=generator))
    return out


def features(
    tables: list[EmbeddingBagConfig], ids: list[torch.Tensor], bags: int
) -> SparseFeatures:
    keys = tuple(t.name for t in tables)
    lengths = [torch.full((bags,), int(k), dtype=torch.int64) for k in per_bag().values()]
    return SparseFeatures(keys, torch.cat(ids), torch.cat(lengths))


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--batch", type=int, default=4096, help="global batch (all ranks)")
    add("--row-scale", type=float, default=1.0, help="scale every table's rows (toy runs)")
    add("--steps", type=int, default=10)
    add("--warmup", type=int, default=2)
    add("--repeats", type=int, default=3)


def measure_plan(
    strategy: mp.ManualParallelStrategy, emb: Any, step: Callable[[], None], args: Any
) -> list[list[list[float]]]:
    """[rank][step][field] (FIELDS) of `args.steps` steps after `args.warmup`."""
    for _ in range(args.warmup):
        step()
    rows = []
    for _ in range(args.steps):
        strategy.barrier()
        emb.phase_times.start()
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        phases = emb.phase_times.stop()
        rows.append([wall, cpu, *(phases.get(p, 0.0) for p in PHASES)])
    gathered = strategy.all_gather(torch.tensor(rows, dtype=torch.float64))
    return gathered.tolist()


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    tables, world = configs(args), strategy.world_size
    local = args.batch // world
    data = [
        features(tables, rank_batch(tables, strategy.rank, local, s), local)
        for s in range(args.warmup + args.steps)
    ]
    plans = {
        n: EmbeddingPlan.from_dict(p) for n, p in json.loads(Path(args.plans).read_text()).items()
    }
    built = {}
    for name, plan in plans.items():
        with mp.empty_init():
            ebc = EmbeddingBagCollection(tables, seed=0)
        emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.01))
        built[name] = (emb, cycling_step(emb, data))
    names = list(plans)
    runs: dict[str, list[Any]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            runs[name].append(measure_plan(strategy, *built[name], args))
    if strategy.is_global_zero:
        where = strategy.environment
        shape = {"world_size": world, "ranks_per_node": where.local_world_size}
        Path(args.result).write_text(json.dumps({"fields": FIELDS, "job": shape, "runs": runs}))
    strategy.teardown()


def agent_command(args: argparse.Namespace, node: int, port: int, extra: list[str]) -> list[str]:
    """Node `node`'s torchrun agent; each node its own loopback address, so that c10d (which
    orders nodes by address) numbers them as given."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *("--nnodes", str(args.nodes), "--node-rank", str(node)),
        *("--nproc-per-node", str(args.nproc_per_node)),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
        *("--rdzv-id", f"cost-model-{port}", "--local-addr", f"127.0.0.{100 + node}"),
        *("--rdzv-conf", f"is_host={str(node == 0).lower()},join_timeout=300"),
        str(Path(__file__).resolve()),
        *extra,
    ]


def run_job(args: argparse.Namespace, plans: dict[str, EmbeddingPlan], folder: Path) -> dict:
    """Start one agent a node, wait for the job, and return rank 0's measurements."""
    (folder / "plans.json").write_text(json.dumps({n: p.to_dict() for n, p in plans.items()}))
    extra = [
        *("--plans", str(folder / "plans.json"), "--result", str(folder / "result.json")),
        *(f"--{k}={getattr(args, k.replace('-', '_'))}" for k in ("batch", "row-scale")),
        *(f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "repeats")),
    ]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [open(folder / f"node{n}.log", "w") for n in range(args.nodes)]  # noqa: SIM115
    agents = [
        subprocess.Popen(
            agent_command(args, n, port, extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        for n, log in enumerate(logs)
    ]
    deadline = time.monotonic() + args.timeout
    codes: list[int | None] = [None]
    try:
        codes = [a.wait(timeout=max(deadline - time.monotonic(), 1)) for a in agents]
    except subprocess.TimeoutExpired:
        pass  # the job took longer than --timeout: stopped below, reported as failed
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)  # the agent and its workers: a session of their own
                agent.wait()
        for log in logs:
            log.close()
    if codes != [0] * args.nodes:
        tail = "".join((folder / f"node{n}.log").read_text()[-3000:] for n in range(args.nodes))
        raise RuntimeError(f"the {args.nodes}-node job failed (exit codes {codes}):\n{tail}")
    return dict(json.loads((folder / "result.json").read_text()))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_args(parser)
    parser.add_argument("--plans", required=True, help="{name: plan} (EmbeddingPlan.to_dict)")
    parser.add_argument("--result", required=True, help="the JSON rank 0 writes")
    worker(parser.parse_args())
