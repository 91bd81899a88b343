"""FBGEMM's CPU table-batched embedding on one table, the peer of bench_embedding_kernels.py.

    .venv-torchrec/bin/python examples/benchmarks/peer_fbgemm_kernels.py --rows 1000000 16000000

Runs in the TorchRec peer environment (`make torchrec-peer`), never in manualpar's: one table of
rows x 64 fp32 on the host, EXACT_ROWWISE_ADAGRAD applied in backward, fresh uniform ids each
repetition (2048 bags of 20), one thread. Times, in this process's CPU time as
bench_embedding_kernels.py does, the forward lookup and the backward with its fused update, so
FBGEMM's kernels (and their growth with table size) can be set beside manualpar's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from embedding_workload import add_kernel_args, run_per_table_size
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    EmbeddingLocation,
    OptimType,
    SplitTableBatchedEmbeddingBagsCodegen,
)


def measure(rows: int, args: argparse.Namespace) -> dict:
    table = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, args.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
        eps=1e-8,
    )
    offsets = torch.arange(0, args.bags * args.ids_per_bag + 1, args.ids_per_bag)
    forward, backward = [], []
    for repeat in range(args.warmup + args.repeats):
        ids = torch.randint(0, rows, (args.bags * args.ids_per_bag,))
        started = time.process_time()
        out = table(ids, offsets)
        looked_up = time.process_time()
        out.backward(torch.ones_like(out))
        updated = time.process_time()
        if repeat >= args.warmup:
            forward.append(1000 * (looked_up - started))
            backward.append(1000 * (updated - looked_up))
    return {
        "rows": rows,
        "forward_ms": statistics.median(forward),
        "backward_update_ms": statistics.median(backward),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_kernel_args(parser)
    args = parser.parse_args()
    run_per_table_size(
        args,
        measure,
        lambda r: (
            f": forward {r['forward_ms']:.2f} ms, backward with update "
            f"{r['backward_update_ms']:.2f} ms"
        ),
    )


if __name__ == "__main__":
    main()
