"""ddp() and fsdp() step time against raw torch DDP and fully_shard, side by side.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/benchmarks/bench_dense.py --json runs/bench_dense.json

Each repeat builds every variant from the same seed and times `--steps` training steps (forward,
backward, Adam step) after `--warmup`; variants run interleaved, in alternating order, and the
ratio of medians is reported per repeat and overall (median over repeats). Target: <= 1.02x.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial

import torch
from bench_common import compare_builders, environment_info, write_json
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import manualpar as mp
from manualpar import ddp, fsdp


def make_model(hidden: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 1))


def raw_ddp(model: nn.Module, strategy: mp.ManualParallelStrategy) -> nn.Module:
    return DistributedDataParallel(model, process_group=strategy.group)


def raw_fsdp(model: nn.Sequential, strategy: mp.ManualParallelStrategy) -> nn.Module:
    for block in model:
        if isinstance(block, nn.Linear):
            fully_shard(block)
    fully_shard(model)  # (in place: the model's class becomes an FSDP one)
    return model


def manualpar_fsdp(model: nn.Sequential, strategy: mp.ManualParallelStrategy) -> nn.Module:
    return fsdp(model, strategy, wrap=(nn.Linear,))


Wrap = Callable[[nn.Sequential, mp.ManualParallelStrategy], nn.Module]


def built(wrap: Wrap, hidden: int, layers: int, strategy: mp.ManualParallelStrategy) -> nn.Module:
    return wrap(make_model(hidden, layers), strategy)


VARIANTS: dict[str, dict[str, Wrap]] = {
    "ddp": {"baseline": raw_ddp, "manualpar": ddp},
    "fsdp": {"baseline": raw_fsdp, "manualpar": manualpar_fsdp},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    strategy = mp.ManualParallelStrategy()
    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(1))
    results: dict[str, dict] = {}
    for family, pair in VARIANTS.items():
        build = {
            name: partial(built, wrap, args.hidden, args.layers, strategy)
            for name, wrap in pair.items()
        }
        results[family] = compare_builders(
            strategy, family, build, x, steps=args.steps, warmup=args.warmup, repeats=args.repeats
        )
    if strategy.is_global_zero:
        write_json(
            args.json,
            {
                "benchmark": "bench_dense",
                "config": vars(args),
                "environment": environment_info(strategy),
                "results": results,
            },
        )
    strategy.teardown()


if __name__ == "__main__":
    main()
