"""TorchRec + FBGEMM (CPU) peer of the embedding benchmark: the same workload, sharded by TorchRec.

Runs from its own environment (`make torchrec-peer` builds `.venv-torchrec`), never imports
manualpar, and shares only embedding_workload.py with the other variants:

    .venv-torchrec/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/peer_torchrec.py --plan table_wise --result out.json

The tables are declared on the meta device, given a fused row-wise Adagrad (applied inside
backward) and only then sharded and materialized by DistributedModelParallel. The optimizer must
be attached before the plan is built: without it TorchRec picks the DENSE compute kernel instead
of FBGEMM's FUSED one. The plan is built by hand, because TorchRec's planner never proposes
row-wise sharding on CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from embedding_workload import (
    add_workload_args,
    batch_features,
    max_over_ranks,
    time_steps,
    write_result,
)
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.optim import RowWiseAdagrad

# FBGEMM's CPU kernels take float32 and float16 rows (bf16 compares against float32)
DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}


def build_model(args: argparse.Namespace, rank: int, world: int) -> DistributedModelParallel:
    common = [
        {
            "name": f"t{i}",
            "embedding_dim": args.dim,
            "num_embeddings": args.rows,
            "feature_names": [f"f{i}"],
            "data_type": DATA_TYPES[args.dtype],
        }
        for i in range(args.tables)
    ]
    meta = torch.device("meta")
    ebc: EmbeddingBagCollection | EmbeddingCollection
    if args.sequence:  # unpooled: a row per id
        ebc = EmbeddingCollection([EmbeddingConfig(**c) for c in common], device=meta)
    else:
        bags = [EmbeddingBagConfig(**c, pooling=PoolingType.SUM) for c in common]
        ebc = EmbeddingBagCollection(bags, device=meta)
    # Before planning: the plan's compute kernel is FUSED only for parameters that carry an
    # in-backward optimizer (torchrec.distributed.sharding_plan._get_compute_kernel).
    _apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": args.lr, "eps": 1e-8})

    if args.plan == "table_wise":
        # Contiguous blocks of tables per rank, as even as the counts allow.
        per_table = {f"t{i}": table_wise(rank=i * world // args.tables) for i in range(args.tables)}
    else:
        per_table = {f"t{i}": row_wise() for i in range(args.tables)}
    module_plan = construct_module_sharding_plan(
        ebc,
        per_table,
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        world_size=world,
        device_type="cpu",
    )
    plan = ShardingPlan({"": module_plan})
    if rank == 0:
        print(plan, file=sys.stderr, flush=True)
    kernels = {sharding.compute_kernel for sharding in module_plan.values()}
    if kernels != {"fused"}:
        raise RuntimeError(f"expected the FUSED compute kernel, the plan has {sorted(kernels)}")

    return DistributedModelParallel(
        ebc,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=plan,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser)
    args = parser.parse_args()
    if args.dtype not in DATA_TYPES:
        raise SystemExit(f"--dtype {args.dtype}: the peer runs {', '.join(DATA_TYPES)}")

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    started, cpu_started = time.perf_counter(), time.process_time()
    model = build_model(args, rank, world)
    init_s = max_over_ranks(time.perf_counter() - started)
    init_cpu_s = max_over_ranks(time.process_time() - cpu_started)  # all threads: load-proof

    module_plan = model.plan.get_plan_for_module("")
    kernel = sorted({sharding.compute_kernel for sharding in module_plan.values()})
    sharding = sorted({sharding.sharding_type for sharding in module_plan.values()})

    keys = [f"f{i}" for i in range(args.tables)]

    def step(index: int) -> None:
        ids, lengths = batch_features(args, rank, world, index)
        features = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids, lengths=lengths)
        out = model(features)  # KeyedTensor (local_batch, tables * dim), keys in plan order
        if args.sequence:  # {feature: JaggedTensor}: every id's row
            values = torch.cat([out[key].values().reshape(-1, args.dim) for key in keys])
        else:
            values = out.values()
        loss = values.square().mean()
        loss.backward()  # the fused row-wise Adagrad updates the touched rows here

    step_ms = time_steps(step, args)
    write_result(
        args,
        "torchrec",
        step_ms,
        init_s,
        kernel=",".join(kernel),
        sharding=",".join(sharding),
        init_cpu_s=init_cpu_s,
    )
    if rank == 0:
        print(
            f"torchrec {args.plan}: {statistics.median(step_ms):.1f} ms/step "
            f"(median), init {init_s:.1f} s -> {args.result}",
            file=sys.stderr,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
