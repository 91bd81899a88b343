"""The step time of half-precision exchanges against float32 ones (step/wire.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_wire_dtype.py --wire fp16 --json runs/bench_wire_dtype.json

The same float32 tables (RowWiseAdagrad, embedding_workload.py's uniform ids) train in the same
processes with their pooled outputs and gradients sent in float32 (the default) and in `--wire`
(bf16: both in bfloat16; fp16: pooled outputs in float16, gradients in bfloat16; fp8: pooled
outputs in float8_e4m3fn, gradients in bfloat16), in alternating order per repeat
(paired_steps.py); the median ratio of their step times and the milliseconds per step saved
are reported. On one host the exchanges are memory copies: the casts can cost more than the
bytes they save; across hosts the saving is the halved bytes on the network.
"""

from __future__ import annotations

import sys

import torch
from bench_common import cycling_step
from paired_steps import build_tables, compare, parse_args, workload

import manualpar as mp
from manualpar.embeddings.step.wire import WIRE_NAMES


def main() -> None:
    wire = "bf16"
    if "--wire" in sys.argv:  # paired_steps' parser knows only the shared options
        at = sys.argv.index("--wire")
        wire = sys.argv[at + 1]
        del sys.argv[at : at + 2]
    args = parse_args(__doc__.splitlines()[0], plan="row_wise")
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    data = workload(args, strategy, args.warmup + args.steps)
    steps = {
        variant: cycling_step(build_tables(args, strategy, wire_dtype=WIRE_NAMES[variant]), data)
        for variant in ("fp32", wire)
    }
    compare(args, strategy, steps)
    strategy.teardown()


if __name__ == "__main__":
    main()
