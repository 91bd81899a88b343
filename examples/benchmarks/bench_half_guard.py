"""The cost of guarding half rows against overflow in the update (step/half_overflow.py).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_half_guard.py --rows 1000000 --dtype fp16 \\
        --json runs/bench_half_guard.json
    python examples/benchmarks/bench_half_guard.py --rows 1000000 --clock cpu

The same half tables (RowWiseAdagrad, or Adam with `--rule adam`; embedding_workload.py's
uniform ids) train in the same
processes without the guard (`guard_half_rows=False`) and with it: `--guard bounded` is the
default (`guard_half_rows=None`: rows copied aside only when a rank's bound cannot rule an
overflow out), `--guard copy` is `guard_half_rows=True` (for row-wise Adagrad the same; it
copied the touched rows every step before the bounds), `--guard none` times the unguarded
tables against themselves (the spread of the measurement). Alternating order per repeat
(paired_steps.py); the median ratio of their step times and the extra milliseconds per step
are reported. `--clock cpu`: each rank's CPU time per step (averaged over the ranks) instead
of the slowest rank's wall clock, for a loaded host. `--clock flags` times the agreement alone
(no tables): the guard's answers riding in the non-finite flags' all_reduce (one float64[6],
finite_check.py) against two small all_reduces (an int64 flag and the answers, as before they
were folded), in process CPU, calling thread CPU and wall time (`--repeats` rounds of 200).
`--betas 0.95,0.5` (with `--rule adam`): Adam's betas, e.g. b1^2 >= b2, where its moments'
bound grows with every update and is read again from the moments (step/adam_bounds.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from bench_common import cycling_step, median
from paired_steps import build_tables, compare, parse_args, workload

import manualpar as mp
from manualpar.embeddings import Adam, RowWiseAdagrad

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
GUARDS = {"bounded": None, "copy": True, "none": False}
RULES = {"rowwise_adagrad": RowWiseAdagrad, "adam": Adam}


def _own_options() -> tuple[str, str, str, str, str]:
    """Take this script's options out of argv (the rest are paired_steps.py's)."""
    values = {
        "--dtype": "fp16",
        "--guard": "bounded",
        "--clock": "wall",
        "--rule": "rowwise_adagrad",
        "--betas": "0.9,0.999",
    }
    rest = [sys.argv[0]]
    args = iter(sys.argv[1:])
    for arg in args:
        if arg in values:
            values[arg] = next(args)
        else:
            rest.append(arg)
    sys.argv = rest
    if values["--dtype"] not in DTYPES or values["--guard"] not in GUARDS:
        raise SystemExit(f"--dtype one of {sorted(DTYPES)}, --guard one of {sorted(GUARDS)}")
    if values["--clock"] not in ("wall", "cpu", "flags"):
        raise SystemExit("--clock wall, cpu or flags")
    if values["--rule"] not in RULES:
        raise SystemExit(f"--rule one of {sorted(RULES)}")
    return (
        values["--dtype"],
        values["--guard"],
        values["--clock"],
        values["--rule"],
        values["--betas"],
    )


def _cpu_compare(
    strategy: mp.ManualParallelStrategy,
    steps: dict[str, Callable[[], None]],
    count: int,
    warmup: int,
    repeats: int,
) -> None:
    """CPU seconds per step of each variant (each rank's own, averaged over the ranks: a rank
    waiting on a collective sleeps), alternating order per repeat."""
    base, candidate = steps
    for step in steps.values():
        for _ in range(warmup):
            step()
    ms: dict[str, list[float]] = {v: [] for v in steps}
    for repeat in range(repeats):
        for v in [base, candidate] if repeat % 2 == 0 else [candidate, base]:
            strategy.barrier()
            started = time.process_time()
            for _ in range(count):
                steps[v]()
            mine = torch.tensor((time.process_time() - started) / count, dtype=torch.float64)
            total = strategy.all_reduce(mine, op="sum").item()
            ms[v].append(1000 * total / strategy.world_size)
    ratios = [c / b for b, c in zip(ms[base], ms[candidate], strict=True)]
    if strategy.is_global_zero:
        print(
            f"cpu: {median(ms[base]):.2f} ms {base}, {median(ms[candidate]):.2f} ms "
            f"{candidate}: x{median(ratios):.3f} "
            f"(repeats {', '.join(f'{r:.3f}' for r in ratios)})",
            flush=True,
        )


def _flags_compare(strategy: mp.ManualParallelStrategy, repeats: int, count: int = 200) -> None:
    """The flags' agreement as the step issues it (one all_reduce) against two (see above)."""
    total = torch.randn(1024, 512).sum()
    answers = [0.0, 0.5, 3.0, 20480.0, 0.0]  # unsafe, share, largest, served, shared

    def two() -> None:
        flag = (~torch.isfinite(total)).to(torch.int64).reshape(1)
        first = strategy.all_reduce_async(flag, name="flag")
        second = strategy.all_reduce_async(torch.tensor(answers, dtype=torch.float64))
        bool(first.wait().any()), second.wait().tolist()

    def one() -> None:
        riders = torch.tensor(answers, dtype=torch.float64)
        flag = (~torch.isfinite(total)).to(torch.float64).reshape(1)
        flags = strategy.all_reduce_async(torch.cat((flag, riders)), name="flags")
        bool(flags.wait()[0]), flags.wait()[1:].tolist()

    clocks = {"process": time.process_time, "thread": time.thread_time, "wall": time.perf_counter}
    ms: dict[tuple[str, str], list[float]] = {(c, v): [] for c in clocks for v in ("two", "one")}
    steps = {"two": two, "one": one}
    for repeat in range(repeats):
        for v in ("two", "one") if repeat % 2 == 0 else ("one", "two"):
            strategy.barrier()
            started = {c: clock() for c, clock in clocks.items()}
            for _ in range(count):
                steps[v]()
            for c, clock in clocks.items():
                mine = torch.tensor((clock() - started[c]) / count, dtype=torch.float64)
                ms[c, v].append(1000 * strategy.all_reduce(mine, op="mean").item())
    if strategy.is_global_zero:
        for c in clocks:
            saved = median([a - b for a, b in zip(ms[c, "two"], ms[c, "one"], strict=True)])
            print(
                f"{c}: {median(ms[c, 'two']):.3f} ms two all_reduces, "
                f"{median(ms[c, 'one']):.3f} ms one: {saved:.3f} ms saved a rank and step",
                flush=True,
            )


def _rule(name: str, lr: float, betas: str) -> Adam | RowWiseAdagrad:
    """The update rule named by --rule (Adam with --betas)."""
    if name == "adam":
        first, second = (float(beta) for beta in betas.split(","))
        return Adam(lr=lr, betas=(first, second))
    return RowWiseAdagrad(lr=lr)


def main() -> None:
    dtype, guard, clock, rule, betas = _own_options()
    args = parse_args(__doc__.splitlines()[0], plan="table_wise")
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    if clock == "flags":
        _flags_compare(strategy, args.repeats)
        strategy.teardown()
        return
    data = workload(args, strategy, args.warmup + args.steps)
    steps = {
        variant: cycling_step(
            build_tables(
                args,
                strategy,
                DTYPES[dtype],
                _rule(rule, args.lr, betas),
                guard_half_rows=GUARDS[guard] if variant == "guarded" else False,
            ),
            data,
        )
        for variant in ("unguarded", "guarded")
    }
    if strategy.is_global_zero:
        print(f"{dtype} rows, {rule} (betas {betas}), guard {guard}", flush=True)
    if clock == "cpu":
        _cpu_compare(strategy, steps, args.steps, args.warmup, args.repeats)
    else:
        compare(args, strategy, steps)
    strategy.teardown()


if __name__ == "__main__":
    main()
