"""Sharded embeddings: manualpar against a plain-torch baseline and TorchRec + FBGEMM.

    python examples/benchmarks/bench_embeddings.py --repeats 3 --json runs/bench_embeddings.json \
        [--peer-python .venv-torchrec/bin/python]        # `make torchrec-peer` builds it
    python examples/benchmarks/bench_embeddings.py --scale --json runs/bench_scale.json \
        [--peer-python .venv-torchrec/bin/python]        # TorchRec's own growth alongside
    ... --floor     # also manualpar's step with no exchanges: the floor its kernels set
    ... --pipelined # also manualpar's step through TrainPipeline (against the floor too)
    ... --batch-tables  # also manualpar's step with its table batch (one call for all tables)
    ... --sequence --peer-python .venv-torchrec/bin/python   # EmbeddingCollection, unpooled
    ... --sequence --lengths uniform --skip-padded --rows 200000 --peer-python ...
                    # sequences of 0 to 2 x --ids-per-bag ids (the same mean), 200k-row tables
    ... --plans row_wise --ids zipf --zipf-exponent 1.05 --peer-python ...
                    # Zipf ids (hot rows spread by a fixed permutation), the same for every variant
    ... --baseline-src ../manualpar-before   # also manualpar imported from another checkout
                    # (manualpar-baseline): this tree's worker and workload, the same repeats
    python examples/benchmarks/bench_embeddings.py --precision --plans table_wise \
        --peer-python .venv-torchrec/bin/python --json runs/bench_precision.json
                    # half tables: manualpar fp16 vs TorchRec FP16, manualpar bf16 vs FP32

Each measurement is a fresh 2-process torchrun job (init time and peak RSS are per process);
variants alternate in a rotating order and repeat, and the report gives the median over repeats
of the per-repeat ratio manualpar / other. Workload (embedding_workload.py): 8 tables x 1M rows
x 64 fp32, global batch 2048, 20 ids per bag, uniform ids, fused row-wise Adagrad, table-wise
and row-wise plans; a step is forward + backward with the fused update, timed as the slowest
rank's, median of 20 after 5 warm-up steps. Every report also gives each variant's step as a
multiple of the workload's memory floor (memory_floor.py: the rows a rank reads and writes per
step, at this host's streaming and random-access rates, probed before the first job), printed
beside the TorchRec ratio and recorded in the JSON ("memory_floor", "x_memory_floor").

The baseline is what one writes with torch alone (embedding_torch_baseline.py):
nn.EmbeddingBag(sparse=True) per table (or row block), ids and pooled rows exchanged with
all_to_all_single, torch.optim.Adagrad on the sparse gradients (torch has no row-wise Adagrad,
so its state is a full table copy). For row-wise it sends every id to every rank and masks the
rows a rank does not hold.

This script holds the workers (`--worker`, run under torchrun) and the command line; the jobs
and variants are embedding_jobs.py's, the modes embedding_compare.py's (the default),
embedding_scale.py's (--scale) and embedding_precision.py's (--precision).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


# --- workers (run under torchrun) --------------------------------------------------------------
def worker_manualpar(args: argparse.Namespace) -> None:
    import itertools

    import torch
    from embedding_workload import batch_features, max_over_ranks, time_steps, write_result

    import manualpar as mp
    from manualpar.embeddings import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        EmbeddingPlan,
        RowWiseAdagrad,
        SparseFeatures,
        row_wise,
        shard_embeddings,
        table_wise,
    )
    from manualpar.embeddings.planning import table_dtype

    strategy = mp.ManualParallelStrategy()
    world, rank = strategy.world_size, strategy.rank
    dtype = table_dtype(args.dtype)
    config = EmbeddingConfig if args.sequence else EmbeddingBagConfig
    tables = [
        config(f"t{i}", args.rows, args.dim, feature_names=(f"f{i}",), dtype=dtype)
        for i in range(args.tables)
    ]
    placement = {
        t.name: table_wise(i * world // args.tables) if args.plan == "table_wise" else row_wise()
        for i, t in enumerate(tables)
    }
    strategy.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    with mp.empty_init():
        sequence = [t for t in tables if isinstance(t, EmbeddingConfig)]  # (all, or none)
        ebc = EmbeddingCollection(sequence) if args.sequence else EmbeddingBagCollection(tables)
    emb = shard_embeddings(
        ebc, strategy, EmbeddingPlan(world, placement), RowWiseAdagrad(lr=args.lr, eps=1e-8)
    )
    init_s = max_over_ranks(time.perf_counter() - started)
    init_cpu_s = max_over_ranks(time.process_time() - cpu_started)  # all threads: load-proof
    keys = tuple(f"f{i}" for i in range(args.tables))
    if args.padded:  # the exchange before compact layouts: every bag, every owner
        emb.step.parts.layout.send_every_bag()
    if args.batch_tables:  # one lookup and one update call for all tables, not one per table
        emb.step.batches_tables = True

    def features(index: int) -> SparseFeatures:
        return SparseFeatures(keys, *batch_features(args, rank, world, index))

    # --pipelined: the batches through TrainPipeline, in order (each step's own index is the
    # pipeline's next batch), so batch i + 1's input dist runs before step i's lookup
    pipeline = (
        iter(mp.TrainPipeline(map(features, itertools.count()), strategy, emb.prefetch))
        if args.pipelined
        else None
    )

    def step(index: int) -> None:
        out = emb(next(pipeline) if pipeline is not None else features(index))
        if args.sequence:  # every id's row: the same loss as the peer's
            values = torch.cat([out[key].values.reshape(-1, args.dim) for key in keys])
        else:
            values = out.values
        values.square().mean().backward()

    name = "pipelined" if args.pipelined else "manualpar"
    steps = time_steps(step, args)
    source = str(Path(mp.__file__).resolve().parent.parent)  # --baseline-src's, or this tree
    write_result(
        args, name, steps, init_s, sharding=args.plan, init_cpu_s=init_cpu_s, source=source
    )
    strategy.teardown()


def worker_local(args: argparse.Namespace) -> None:
    """manualpar's step without its exchanges: a floor for any exchange scheme on its kernels.

    Each process holds, in a one-process module, exactly the shard it holds in the sharded run
    and is fed the ids the sharded run would route to it (from every rank's batch), so it does
    the same lookups, grouping and fused updates; the two processes still run at the same time,
    sharing memory bandwidth as in the real step. Nothing is exchanged or packed; the loss is
    taken over the same number of pooled values as a rank's output in the sharded run.
    """
    import torch
    import torch.distributed as dist
    from embedding_workload import batch_ids, max_over_ranks, time_steps, write_result

    import manualpar as mp
    from manualpar.embeddings import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingPlan,
        RowWiseAdagrad,
        SparseFeatures,
        shard_embeddings,
        table_wise,
    )

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    alone = [dist.new_group([r]) for r in range(world)][rank]
    strategy = mp.ManualParallelStrategy(process_group=alone)
    if args.plan == "table_wise":
        mine = [t for t in range(args.tables) if t * world // args.tables == rank]
        lo, hi = 0, args.rows
    else:
        mine = list(range(args.tables))
        lo, hi = args.rows * rank // world, args.rows * (rank + 1) // world
    tables = [
        EmbeddingBagConfig(f"t{t}", hi - lo, args.dim, feature_names=(f"f{t}",)) for t in mine
    ]
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables)
    emb = shard_embeddings(
        ebc,
        strategy,
        EmbeddingPlan(1, {t.name: table_wise(0) for t in tables}),
        RowWiseAdagrad(lr=args.lr, eps=1e-8),
    )
    init_s = max_over_ranks(time.perf_counter() - started)
    init_cpu_s = max_over_ranks(time.process_time() - cpu_started)  # all threads: load-proof
    keys = tuple(f"f{t}" for t in mine)
    bags_per_rank = args.batch // world

    def routed_here(index: int) -> SparseFeatures:
        """Every sender's bags of this rank's tables, keeping only ids of its rows."""
        ids = torch.cat(
            [batch_ids(args, sender, world, index)[mine] for sender in range(world)], 1
        ).view(len(mine), -1, args.ids_per_bag)
        if args.plan == "table_wise":
            return SparseFeatures(
                keys,
                ids.flatten(),
                torch.full((ids.numel() // args.ids_per_bag,), args.ids_per_bag),
            )
        held = (ids >= lo) & (ids < hi)
        return SparseFeatures(keys, ids[held] - lo, held.sum(2).flatten())

    routed = [routed_here(index) for index in range(args.warmup + args.steps)]
    looked_up = torch.tensor([routed[0].values.numel()])
    dist.all_reduce(looked_up)  # every id of step 0, over both ranks: the whole batch's

    def step(index: int) -> None:
        batch_ids(args, rank, world, index)  # drawn as in the sharded step, whose ids are routed
        pooled = emb(routed[index]).values  # (world * local batch, dims of this rank's tables)
        if args.plan == "row_wise":  # partial sums of every rank's bags: the reduce-scatter's input
            pooled = pooled.view(world, bags_per_rank, -1).sum(0)
        pooled.square().mean().backward()

    write_result(
        args,
        "local",
        time_steps(step, args),
        init_s,
        sharding=args.plan,
        ids_looked_up=looked_up.item(),
        init_cpu_s=init_cpu_s,
    )
    dist.destroy_process_group()


def main() -> None:
    import job_launch
    from embedding_workload import LENGTHS, add_id_args, add_workload_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("manualpar", "baseline", "local"))
    if "--worker" in sys.argv:
        add_workload_args(parser)
        parser.add_argument("--padded", action="store_true", help=argparse.SUPPRESS)
        parser.add_argument("--pipelined", action="store_true", help=argparse.SUPPRESS)
        parser.add_argument("--batch-tables", action="store_true", help=argparse.SUPPRESS)
        args = parser.parse_args()
        from embedding_torch_baseline import worker_baseline

        {"manualpar": worker_manualpar, "baseline": worker_baseline, "local": worker_local}[
            args.worker
        ](args)
        return
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plans", nargs="+", default=["table_wise", "row_wise"])
    parser.add_argument("--peer-python", help="python of a venv where torchrec + fbgemm import")
    parser.add_argument(
        "--skip-baseline",
        action="store_true",
        help="leave out the plain-torch baseline (quicker runs against the peer)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run manualpar's step with no exchanges (worker_local)",
    )
    parser.add_argument(
        "--pipelined",
        action="store_true",
        help="also run manualpar's step through TrainPipeline (the next batch's input dist ahead)",
    )
    parser.add_argument(
        "--batch-tables",
        action="store_true",
        help="also run manualpar's step with all tables in one kernel call per phase",
    )
    parser.add_argument("--scale", action="store_true", help="1 -> 4 -> 16 GiB of tables")
    parser.add_argument(
        "--sequence",
        action="store_true",
        help="unpooled tables (EmbeddingCollection against TorchRec's): manualpar and the peer",
    )
    parser.add_argument(
        "--skip-padded", action="store_true", help="--sequence without the padded exchange"
    )
    parser.add_argument(
        "--lengths",
        choices=LENGTHS,
        default="fixed",
        help="ids per bag: --ids-per-bag each, or uniform over 0 .. 2 x --ids-per-bag",
    )
    add_id_args(parser)  # --ids zipf --zipf-exponent 1.05: the same skewed ids for every variant
    job_launch.add_baseline_src(
        parser, "the variant manualpar-baseline (this tree's worker and workload, DIR's manualpar)"
    )
    parser.add_argument(
        "--precision",
        action="store_true",
        help="half tables: manualpar fp16/bf16/fp32 against TorchRec FP16/FP32 (PRECISION_RATIOS)",
    )
    parser.add_argument("--scale-gib", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument("--json")
    for flag, default in (
        ("--tables", 8),
        ("--rows", 1_000_000),
        ("--dim", 64),
        ("--batch", 2048),
        ("--ids-per-bag", 20),
        ("--steps", 20),
        ("--warmup", 5),
    ):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    if args.baseline_src and (args.scale or args.precision):  # before any job starts
        parser.error("--baseline-src runs in the default mode: leave out --scale and --precision")
    if args.sequence and (args.floor or args.scale or args.precision):
        raise SystemExit("--sequence compares manualpar with --peer-python only (no --floor, ...)")
    if args.lengths != "fixed" and args.floor:
        raise SystemExit("--floor routes fixed-length bags: leave it out with --lengths uniform")
    from embedding_compare import compare
    from embedding_precision import precision
    from embedding_scale import scale

    payload = scale(args) if args.scale else precision(args) if args.precision else compare(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), **payload}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
