"""fsdp(mesh=2-D) and tp() + fsdp() step time against raw torch on the same meshes, side by side.

    python -m torch.distributed.run --standalone --nproc-per-node 4 \
        examples/benchmarks/bench_mesh_dense.py --json runs/bench_mesh_dense.json

Two families, each manualpar against the torch calls it is built on, on the same mesh:
  hsdp     `fsdp(model, strategy, mesh=strategy.mesh(replicate=R, shard=2), wrap=(nn.Linear,))`
           against `fully_shard` on each Linear and the root with that 2-D mesh;
  fsdp_tp  `tp(model, mesh=mesh["tp"], plan=...)` then `fsdp(model, mesh=mesh["dp"])` on
           `strategy.mesh(dp=R, tp=2)` against `parallelize_module` (ColwiseParallel /
           RowwiseParallel) then `fully_shard` on the same dims (tensor parallel with fsdp on dp).
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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import manualpar as mp


def make_model(hidden: int, layers: int) -> nn.Sequential:
    """`layers` pairs of Linear(h, 2h) -> GELU -> Linear(2h, h) -> GELU, then a head."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)]
        blocks += [nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 1))


def built(wrap: Callable[[nn.Sequential], nn.Module], hidden: int, layers: int) -> nn.Module:
    return wrap(make_model(hidden, layers))


def tp_plan(model: nn.Sequential) -> dict[str, str]:
    """Each pair's first Linear colwise, its second rowwise (one all-reduce per pair); the
    head stays whole."""
    linears = [str(i) for i, m in enumerate(model) if isinstance(m, nn.Linear)][:-1]
    return {name: ("colwise" if k % 2 == 0 else "rowwise") for k, name in enumerate(linears)}


def raw_hsdp(model: nn.Sequential, mesh: DeviceMesh) -> nn.Module:
    for block in model:
        if isinstance(block, nn.Linear):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # (in place: the model's class becomes an FSDP one)
    return model


def raw_fsdp_tp(model: nn.Sequential, mesh: DeviceMesh) -> nn.Module:
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {name: styles[style]() for name, style in tp_plan(model).items()}
    parallelize_module(model, mesh["tp"], plan)
    return raw_hsdp(model, mesh["dp"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    strategy = mp.ManualParallelStrategy()
    if strategy.world_size % 2:
        raise SystemExit(f"bench_mesh_dense: needs an even world size, got {strategy.world_size}")
    outer = strategy.world_size // 2
    hsdp_mesh = strategy.mesh(replicate=outer, shard=2)
    tp_mesh = strategy.mesh(dp=outer, tp=2)

    def mp_hsdp(model: nn.Sequential) -> nn.Module:
        return mp.fsdp(model, strategy, mesh=hsdp_mesh, wrap=(nn.Linear,))

    def mp_fsdp_tp(model: nn.Sequential) -> nn.Module:
        mp.tp(model, strategy, mesh=tp_mesh["tp"], plan=tp_plan(model))
        return mp.fsdp(model, strategy, mesh=tp_mesh["dp"], wrap=(nn.Linear,))

    variants: dict[str, dict[str, Callable[[nn.Sequential], nn.Module]]] = {
        "hsdp": {"baseline": lambda m: raw_hsdp(m, hsdp_mesh), "manualpar": mp_hsdp},
        "fsdp_tp": {"baseline": lambda m: raw_fsdp_tp(m, tp_mesh), "manualpar": mp_fsdp_tp},
    }
    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(1))
    results: dict[str, dict] = {}
    for family, pair in variants.items():
        build = {
            name: partial(built, wrap, args.hidden, args.layers) for name, wrap in pair.items()
        }
        results[family] = compare_builders(
            strategy, family, build, x, steps=args.steps, warmup=args.warmup, repeats=args.repeats
        )
    if strategy.is_global_zero:
        write_json(
            args.json,
            {
                "benchmark": "bench_mesh_dense",
                "config": vars(args),
                "meshes": {"hsdp": f"replicate={outer} x shard=2", "fsdp_tp": f"dp={outer} x tp=2"},
                "environment": environment_info(strategy),
                "results": results,
            },
        )
    strategy.teardown()


if __name__ == "__main__":
    main()
