"""The C++ kernels at each vector level this CPU has: AVX-512, AVX2 (what a CPU without AVX-512
runs) and the portable loops, side by side in one process.

    python examples/benchmarks/bench_simd_levels.py --json runs/bench_simd_levels.json

An AVX2-only host took the portable loops for half rows and initial values before the AVX2 path
existed: the AVX2 / portable ratio here is the gain on such a host, measured on this one
(set_simd_level lowers the level; the bits are the same at every level, tested). Kernels, one
thread: a half-row lookup (`--bags` bags of `--ids-per-bag` ids over `--rows` x `--dim`), a
half-row update of `--update-rows` distinct rows (bfloat16 stochastic, float16 to nearest),
initial values of a `--rows` x `--dim` float32 block, and the step's fused row-wise Adagrad pass
over the lookup's ids on float32 and bfloat16 rows. Levels interleave in rotating order,
`--repeats` times; medians and ratios to the portable level are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from bench_common import median, write_json

from manualpar.embeddings.kernels.native import native_kernels

LEVELS = {0: "portable", 1: "avx2", 2: "avx512"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--bags", type=int, default=4096)
    parser.add_argument("--ids-per-bag", type=int, default=20)
    parser.add_argument("--update-rows", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json")
    return parser.parse_args(argv)


def kernels_to_time(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    kernels = native_kernels()
    assert kernels is not None
    generator = torch.Generator().manual_seed(0)
    source = torch.randn(args.rows, args.dim, generator=generator)
    lengths = torch.full((args.bags,), args.ids_per_bag)
    ids = torch.randint(0, args.rows, (args.bags * args.ids_per_bag,), generator=generator)
    rows = torch.randperm(args.rows, generator=generator)[: args.update_rows]
    delta = torch.randn(args.update_rows, args.dim, generator=generator) * 1e-2
    out = torch.empty(args.rows, args.dim)
    work: dict[str, Callable[[], object]] = {}
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        weight = source.to(dtype)
        work[f"lookup {name}"] = partial(kernels.pooled_sum_half, weight, ids, lengths, None)
        work[f"update {name}"] = partial(
            kernels.add_to_rows_rounded, weight, rows, delta, -0.1, True, 99, 0, 0, args.dim, None
        )
    work["init float32"] = lambda: kernels.uniform_rows(out, 99, 0, 0, args.dim, 0.01)
    # the step's fused row-wise Adagrad pass over the lookup's ids (float32 and bfloat16 rows)
    groups = kernels.group_rows(ids, lengths, args.rows, 0, args.bags)
    grads = torch.randn(args.bags, args.dim, generator=generator)
    state = torch.zeros(args.rows)
    common = (*groups[:5], 0, groups[4].numel(), [grads], [1.0], 0, args.bags, 0, 0.01, 1e-8)
    weight32, weight16 = source.clone(), source.to(torch.bfloat16)
    work["fused float32"] = lambda: kernels.rowwise_adagrad_update(weight32, state, None, *common)
    work["fused bfloat16"] = lambda: kernels.rowwise_adagrad_update_rounded(
        weight16, state, None, *common, True, 99, 0, args.dim, None
    )
    return work


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    kernels = native_kernels()
    if kernels is None:
        sys.exit("the C++ kernels could not be built on this machine: nothing to compare")
    torch.set_num_threads(1)
    widest = kernels.set_simd_level(2)
    levels = list(range(widest + 1))
    work = kernels_to_time(args)
    seconds: dict[str, dict[int, list[float]]] = {name: {lv: [] for lv in levels} for name in work}
    try:
        for repeat in range(args.repeats):
            order = levels[repeat % len(levels) :] + levels[: repeat % len(levels)]
            for level in order:
                kernels.set_simd_level(level)
                for name, run in work.items():
                    run()  # warm: caches, pages
                    started = time.perf_counter()
                    run()
                    seconds[name][level].append(time.perf_counter() - started)
    finally:
        kernels.set_simd_level(2)
    summary = {}
    for name, by_level in seconds.items():
        ms = {LEVELS[lv]: 1e3 * median(times) for lv, times in by_level.items()}
        summary[name] = {
            "ms": ms,
            "vs_portable": {
                LEVELS[lv]: median([t / p for t, p in zip(times, by_level[0], strict=True)])
                for lv, times in by_level.items()
            },
        }
        ratios = "  ".join(f"{k} {v:.3f}x" for k, v in summary[name]["vs_portable"].items())
        times = "  ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
        print(f"{name:15s} {times}   vs portable: {ratios}", flush=True)
    result = {"args": vars(args), "levels": [LEVELS[lv] for lv in levels], "summary": summary}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
