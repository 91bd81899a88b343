"""Where the non-finite gradient check's cost goes (step/finite_check.py), step by step.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_finite_check.py --rows 1000000 --repeats 20 \\
        --json runs/bench_finite_check.json

Four copies of the same tables (paired_steps.py's workload, RowWiseAdagrad) train in the same
processes, one step each in rotating order, so that a slow minute of a shared machine hits
every variant alike:

- checked: the step as shipped (sum of the output gradient; each rank's flag rides after its
  gradient in the gradient all_to_all, read before the first row is written);
- unchecked: a zero flag rides, never read (the sum's cost apart);
- sum_only: the sum of the output gradient, its flag read locally only;
- late_wait: the flag also summed in an all_reduce of its own (as before the flags rode),
  waited for only at the next step (what starting that collective costs).

Only "checked" keeps the promise that no rank writes a row while any rank's gradient is
non-finite; the others exist to measure it. A step is the slowest rank's; the summary gives
each variant's median and the median of its per-round ratio to "checked".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from bench_common import cycling_step, environment_info, median, write_json
from paired_steps import build_tables, parse_args, workload

import manualpar as mp

VARIANTS = ("checked", "unchecked", "sum_only", "late_wait")


class Unchecked:
    """A stand-in for FiniteCheck that checks nothing."""

    mode, skipped = "raise", 0
    zero = torch.zeros(1)

    def flag(self, grad: torch.Tensor, frozen: frozenset[int]) -> torch.Tensor:
        return self.zero

    def replaced(self, flag: torch.Tensor, unchanged: Callable[[], None]) -> torch.Tensor:
        unchanged()  # a weight replaced mid-step raises here, on its own rank only
        return flag

    def passed(self, pending: Any) -> bool:
        return True


class SumOnly(Unchecked):
    """The check's scan (one sum of the output gradient) without the agreement."""

    def flag(self, grad: torch.Tensor, frozen: frozenset[int]) -> torch.Tensor:
        self.up = ~torch.isfinite(grad.sum())
        return self.zero

    def passed(self, pending: Any) -> bool:
        return not bool(self.up)


class LateWait(Unchecked):
    """The check's scan and its own all_reduce, waited for a step late."""

    def __init__(self, check: Any) -> None:
        self.check = check
        self.pending: Any = None

    def flag(self, grad: torch.Tensor, frozen: frozenset[int]) -> torch.Tensor:
        if self.pending is not None:
            self.pending.wait()
        flag = self.check.flag(grad, frozen)
        self.pending = self.check.start(flag)
        return flag


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], plan="table_wise", steps=15)
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    data = workload(args, strategy, args.warmup + args.steps)
    tables = {variant: build_tables(args, strategy) for variant in VARIANTS}
    for variant, check in (("unchecked", Unchecked()), ("sum_only", SumOnly())):
        tables[variant].step.backward_phases.finite = check
    late = tables["late_wait"].step.backward_phases
    late.finite = LateWait(late.finite)
    steps = {variant: cycling_step(emb, data) for variant, emb in tables.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    ms: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_ in range(args.repeats * args.steps):
        shift = round_ % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            strategy.barrier()
            started = time.perf_counter()
            steps[variant]()
            elapsed = torch.tensor(time.perf_counter() - started, dtype=torch.float64)
            ms[variant].append(1000 * strategy.all_reduce(elapsed, op="max").item())
    summary = {
        variant: {
            "median_ms": median(ms[variant]),
            "vs_checked": median([a / b for a, b in zip(ms[variant], ms["checked"], strict=True)]),
        }
        for variant in VARIANTS
    }
    if strategy.is_global_zero:
        for variant, row in summary.items():
            print(f"{variant:<10} {row['median_ms']:7.2f} ms  x{row['vs_checked']:.3f}", flush=True)
        write_json(
            args.json,
            {"args": vars(args), "summary": summary, "environment": environment_info(strategy)},
        )
    strategy.teardown()


if __name__ == "__main__":
    main()
