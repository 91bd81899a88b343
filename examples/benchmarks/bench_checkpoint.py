"""Checkpoint IO: the training stall of a background save against a synchronous one, and save and
load throughput of manualpar against raw torch.distributed.checkpoint, side by side.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/benchmarks/bench_checkpoint.py --json runs/bench_checkpoint.json

The state is an FSDP-sharded MLP trained one step with Adam (parameters plus two moments:
`--hidden 2048 --layers 6` is about 300 MB in all, half on each rank). Each repeat runs, in
alternating order: (a) `strategy.save_checkpoint` (sync) and `strategy.save_checkpoint_async`
(the stall: until it returns; then `--steps` training steps run while it writes, and the time
left until it committed), and (b) manualpar's save and load against `dcp.save` / `dcp.load` of
the same state dicts (what a plain-torch loop does: get_*_state_dict, dcp, set_*_state_dict),
and manualpar's load with `verify="sizes"` (no CRC-32 pass) beside them.
Every time is the slowest rank's. Files go under `--dir` and are deleted after each repeat.
Targets: async stall <= 0.2x the sync save; throughput >= 0.9x raw DCP.
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from bench_common import environment_info, median, peak_rss_gb, write_json
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import manualpar as mp
from manualpar import fsdp


def make_model(strategy: mp.ManualParallelStrategy, hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.GELU()]
    return fsdp(nn.Sequential(*blocks), strategy, wrap=(nn.Linear,))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, hidden: int) -> None:
    loss = model(torch.randn(8, hidden)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def timed(strategy: mp.ManualParallelStrategy, fn: Callable[[], Any]) -> float:
    """Seconds of `fn` on the slowest rank."""
    strategy.barrier()
    started = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
    return float(strategy.all_reduce(elapsed, op="max"))


def state_bytes(state: dict[str, Any]) -> int:
    """Global bytes of every tensor in the state dicts (what all ranks write together)."""
    total = 0
    for tree in state.values():
        for value in _leaves(tree):
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()  # DTensor: the global size
    return total


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    return [tree]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps trained during a bg save")
    parser.add_argument("--dir", default="runs/bench_checkpoint_files")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    strategy = mp.ManualParallelStrategy()
    measure(strategy, args)  # the model (FSDP) is freed before its process group
    strategy.teardown()


def measure(strategy: mp.ManualParallelStrategy, args: argparse.Namespace) -> None:
    root = Path(args.dir).absolute()
    model = make_model(strategy, args.hidden, args.layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model, optimizer, args.hidden)  # Adam state exists
    state = {"model": model, "optim": optimizer, "step": 1}
    raw = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    total_mb = state_bytes(raw) / 2**20

    def raw_save(path: Path) -> None:
        sd = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
        }
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), process_group=strategy.group)

    def raw_load(path: Path) -> None:
        sd: dict[str, Any] = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
        }
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path), process_group=strategy.group)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, optimizer, sd["optim"])

    for _ in range(2):  # warm-up
        train_step(model, optimizer, args.hidden)
    runs: dict[str, list[float]] = {
        k: []
        for k in (
            "sync_save_s",
            "async_stall_s",
            "async_commit_s",
            "step_s",
            "step_during_async_s",
            "manualpar_save_s",
            "dcp_save_s",
            "manualpar_load_s",
            "manualpar_load_sizes_s",
            "dcp_load_s",
        )
    }
    for repeat in range(args.repeats):
        # (a) the stall: sync save against the background save's copy, alternating order
        def sync() -> None:
            runs["sync_save_s"].append(
                timed(strategy, lambda: strategy.save_checkpoint(root / "sync", state))
            )

        def background() -> None:
            for _ in range(args.steps):  # the same steps without a save in flight
                runs["step_s"].append(
                    timed(strategy, lambda: train_step(model, optimizer, args.hidden))
                )
            runs["async_stall_s"].append(
                timed(strategy, lambda: strategy.save_checkpoint_async(root / "async", state))
            )
            started = time.perf_counter()
            for _ in range(args.steps):
                runs["step_during_async_s"].append(
                    timed(strategy, lambda: train_step(model, optimizer, args.hidden))
                )
            strategy.wait_for_checkpoint()
            runs["async_commit_s"].append(time.perf_counter() - started)

        for run in (sync, background) if repeat % 2 == 0 else (background, sync):
            run()
        # (b) throughput: manualpar against raw DCP on the same state, alternating order
        pairs = [
            ("manualpar_save_s", lambda: strategy.save_checkpoint(root / "mp", state)),
            ("dcp_save_s", lambda: raw_save(root / "dcp")),
        ]
        for name, fn in pairs if repeat % 2 == 0 else pairs[::-1]:
            runs[name].append(timed(strategy, fn))
        loads: list[tuple[str, Callable[[], object]]] = [
            ("manualpar_load_s", lambda: strategy.load_checkpoint(root / "mp", state)),
            ("dcp_load_s", lambda: raw_load(root / "dcp")),
            (
                "manualpar_load_sizes_s",
                lambda: strategy.load_checkpoint(root / "mp", state, verify="sizes"),
            ),
        ]
        first = repeat % len(loads)  # each goes first, second and last in turn
        for name, load in loads[first:] + loads[:first]:
            runs[name].append(timed(strategy, load))
        strategy.barrier()
        if strategy.is_global_zero:
            shutil.rmtree(root, ignore_errors=True)

    med = {k: median(v) for k, v in runs.items()}
    summary: dict[str, Any] = {
        "state_mb": total_mb,
        "median": med,
        "async_stall/sync_save": med["async_stall_s"] / med["sync_save_s"],
        "step_during_async/step": med["step_during_async_s"] / med["step_s"],
        "save_mb_per_s": {
            "manualpar": total_mb / med["manualpar_save_s"],
            "dcp": total_mb / med["dcp_save_s"],
        },
        "load_mb_per_s": {
            "manualpar": total_mb / med["manualpar_load_s"],
            "dcp": total_mb / med["dcp_load_s"],
        },
        "save_throughput manualpar/dcp": med["dcp_save_s"] / med["manualpar_save_s"],
        "load_throughput manualpar/dcp": med["dcp_load_s"] / med["manualpar_load_s"],
        "load_throughput manualpar(verify=sizes)/dcp": med["dcp_load_s"]
        / med["manualpar_load_sizes_s"],
    }
    rss = strategy.all_gather_object(peak_rss_gb())
    if strategy.is_global_zero:
        print(f"state {total_mb:.0f} MB over {strategy.world_size} ranks, {args.repeats} repeats")
        print(
            f"(a) sync save {med['sync_save_s']:.3f} s; async stall {med['async_stall_s']:.3f} s "
            f"= {summary['async_stall/sync_save']:.3f}x; committed {med['async_commit_s']:.3f} s "
            f"after; a step during the write {summary['step_during_async/step']:.2f}x a step"
        )
        for what in ("save", "load"):
            rates = summary[f"{what}_mb_per_s"]
            print(
                f"(b) {what}: manualpar {rates['manualpar']:.0f} MB/s, dcp {rates['dcp']:.0f} "
                f"MB/s = {summary[f'{what}_throughput manualpar/dcp']:.3f}x"
            )
        sizes = summary["load_throughput manualpar(verify=sizes)/dcp"]
        rate = total_mb / med["manualpar_load_sizes_s"]
        print(f'(b) load with verify="sizes": manualpar {rate:.0f} MB/s = {sizes:.3f}x')
    write_json(
        args.json if strategy.is_global_zero else None,
        {
            "benchmark": "checkpoint",
            "args": vars(args),
            "environment": environment_info(strategy),
            "summary": summary,
            "runs": runs,
            "peak_rss_gb_per_rank": rss,
        },
    )


if __name__ == "__main__":
    main()
