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

import torch
from bench_common import environment_info, median, time_steps, write_json
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import manualpar as mp
from manualpar.builders.ddp import ddp
from manualpar.builders.fsdp import fsdp


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
    return fully_shard(model)


def manualpar_fsdp(model: nn.Sequential, strategy: mp.ManualParallelStrategy) -> nn.Module:
    return fsdp(model, strategy, wrap=(nn.Linear,))


VARIANTS: dict[str, dict[str, Callable]] = {
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
        per_repeat: dict[str, list[float]] = {"baseline": [], "manualpar": []}
        for repeat in range(args.repeats):
            order = list(pair) if repeat % 2 == 0 else list(reversed(pair))
            for name in order:
                model = pair[name](make_model(args.hidden, args.layers), strategy)
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

                def step(
                    model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer
                ) -> None:
                    optimizer.zero_grad(set_to_none=True)
                    model(x).pow(2).mean().backward()
                    optimizer.step()

                times = time_steps(strategy, step, args.steps, args.warmup)
                per_repeat[name].append(median(times))
        ratios = [
            m / b for m, b in zip(per_repeat["manualpar"], per_repeat["baseline"], strict=True)
        ]
        results[family] = {
            "baseline_ms": [t * 1e3 for t in per_repeat["baseline"]],
            "manualpar_ms": [t * 1e3 for t in per_repeat["manualpar"]],
            "ratios": ratios,
            "median_ratio": median(ratios),
        }
        if strategy.is_global_zero:
            print(
                f"{family:5s} baseline {median(per_repeat['baseline']) * 1e3:8.2f} ms/step  "
                f"manualpar {median(per_repeat['manualpar']) * 1e3:8.2f} ms/step  "
                f"ratio {median(ratios):.3f}x  (per repeat: "
                + ", ".join(f"{r:.3f}" for r in ratios)
                + ")",
                flush=True,
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
