"""Sharded embeddings: manualpar against a plain-torch baseline and TorchRec + FBGEMM.

    python examples/benchmarks/bench_embeddings.py --repeats 3 --json runs/bench_embeddings.json \
        [--peer-python .venv-torchrec/bin/python]        # `make torchrec-peer` builds it
    python examples/benchmarks/bench_embeddings.py --scale --json runs/bench_scale.json \
        [--peer-python .venv-torchrec/bin/python]        # TorchRec's own growth alongside
    ... --floor     # also manualpar's step with no exchanges: the floor its kernels set
    ... --pipelined # also manualpar's step through TrainPipeline (against the floor too)
    ... --batch-tables  # also manualpar's step with its table batch (one call for all tables)
    ... --sequence --peer-python .venv-torchrec/bin/python   # EmbeddingCollection, unpooled
    ... --sequence --lengths uniform --skip-padded --rows 200000 --peer-python ...
                    # sequences of 0 to 2 x --ids-per-bag ids (the same mean), 200k-row tables
    python examples/benchmarks/bench_embeddings.py --precision --plans table_wise \
        --peer-python .venv-torchrec/bin/python --json runs/bench_precision.json
                    # half tables: manualpar fp16 vs TorchRec FP16, manualpar bf16 vs FP32

Each measurement is a fresh 2-process torchrun job (init time and peak RSS are per process);
variants alternate in a rotating order and repeat, and the report gives the median over repeats
of the per-repeat ratio manualpar / other. Workload (embedding_workload.py): 8 tables x 1M rows
x 64 fp32, global batch 2048, 20 ids per bag, uniform ids, fused row-wise Adagrad, table-wise
and row-wise plans; a step is forward + backward with the fused update, timed as the slowest
rank's, median of 20 after 5 warm-up steps. Every report also gives each variant's step as a
multiple of the workload's memory floor (memory_floor.py: the rows a rank reads and writes per
step, at this host's streaming and random-access rates, probed before the first job), printed
beside the TorchRec ratio and recorded in the JSON ("memory_floor", "x_memory_floor").

The baseline is what one writes with torch alone: nn.EmbeddingBag(sparse=True) per table (or
row block), ids and pooled rows exchanged with all_to_all_single, torch.optim.Adagrad on the
sparse gradients (torch has no row-wise Adagrad, so its state is a full table copy). For
row-wise it sends every id to every rank and masks the rows a rank does not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RANKS = 2  # processes per job (torchrun --nproc-per-node)


# --- workers (run under torchrun) --------------------------------------------------------------
def worker_manualpar(args: argparse.Namespace) -> None:
    import itertools

    import torch
    from embedding_workload import batch_features, max_over_ranks, time_steps, write_result

    import manualpar as mp
    from manualpar.embeddings import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        EmbeddingPlan,
        RowWiseAdagrad,
        SparseFeatures,
        row_wise,
        shard_embeddings,
        table_wise,
    )
    from manualpar.embeddings.planning import table_dtype

    strategy = mp.ManualParallelStrategy()
    world, rank = strategy.world_size, strategy.rank
    dtype = table_dtype(args.dtype)
    config = EmbeddingConfig if args.sequence else EmbeddingBagConfig
    tables = [
        config(f"t{i}", args.rows, args.dim, feature_names=(f"f{i}",), dtype=dtype)
        for i in range(args.tables)
    ]
    placement = {
        t.name: table_wise(i * world // args.tables) if args.plan == "table_wise" else row_wise()
        for i, t in enumerate(tables)
    }
    strategy.barrier()
    started = time.perf_counter()
    with mp.empty_init():
        ebc = (EmbeddingCollection if args.sequence else EmbeddingBagCollection)(tables)
    emb = shard_embeddings(
        ebc, strategy, EmbeddingPlan(world, placement), RowWiseAdagrad(lr=args.lr, eps=1e-8)
    )
    init_s = max_over_ranks(time.perf_counter() - started)
    keys = tuple(f"f{i}" for i in range(args.tables))
    if args.padded:  # the exchange before compact layouts: every bag, every owner
        emb.step.parts.layout.send_every_bag()
    if args.batch_tables:  # one lookup and one update call for all tables, not one per table
        emb.step.batches_tables = True

    def features(index: int) -> SparseFeatures:
        return SparseFeatures(keys, *batch_features(args, rank, world, index))

    # --pipelined: the batches through TrainPipeline, in order (each step's own index is the
    # pipeline's next batch), so batch i + 1's input dist runs before step i's lookup
    pipeline = (
        iter(mp.TrainPipeline(map(features, itertools.count()), strategy, emb.prefetch))
        if args.pipelined
        else None
    )

    def step(index: int) -> None:
        out = emb(next(pipeline) if pipeline is not None else features(index))
        if args.sequence:  # every id's row: the same loss as the peer's
            values = torch.cat([out[key].values.reshape(-1, args.dim) for key in keys])
        else:
            values = out.values
        values.square().mean().backward()

    name = "pipelined" if args.pipelined else "manualpar"
    write_result(args, name, time_steps(step, args), init_s, sharding=args.plan)
    strategy.teardown()


def worker_local(args: argparse.Namespace) -> None:
    """manualpar's step without its exchanges: a floor for any exchange scheme on its kernels.

    Each process holds, in a one-process module, exactly the shard it holds in the sharded run
    and is fed the ids the sharded run would route to it (from every rank's batch), so it does
    the same lookups, grouping and fused updates; the two processes still run at the same time,
    sharing memory bandwidth as in the real step. Nothing is exchanged or packed; the loss is
    taken over the same number of pooled values as a rank's output in the sharded run.
    """
    import torch
    import torch.distributed as dist
    from embedding_workload import batch_ids, max_over_ranks, time_steps, write_result

    import manualpar as mp
    from manualpar.embeddings import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingPlan,
        RowWiseAdagrad,
        SparseFeatures,
        shard_embeddings,
        table_wise,
    )

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    alone = [dist.new_group([r]) for r in range(world)][rank]
    strategy = mp.ManualParallelStrategy(process_group=alone)
    if args.plan == "table_wise":
        mine = [t for t in range(args.tables) if t * world // args.tables == rank]
        lo, hi = 0, args.rows
    else:
        mine = list(range(args.tables))
        lo, hi = args.rows * rank // world, args.rows * (rank + 1) // world
    tables = [
        EmbeddingBagConfig(f"t{t}", hi - lo, args.dim, feature_names=(f"f{t}",)) for t in mine
    ]
    dist.barrier()
    started = time.perf_counter()
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables)
    emb = shard_embeddings(
        ebc,
        strategy,
        EmbeddingPlan(1, {t.name: table_wise(0) for t in tables}),
        RowWiseAdagrad(lr=args.lr, eps=1e-8),
    )
    init_s = max_over_ranks(time.perf_counter() - started)
    keys = tuple(f"f{t}" for t in mine)
    bags_per_rank = args.batch // world

    def routed_here(index: int) -> SparseFeatures:
        """Every sender's bags of this rank's tables, keeping only ids of its rows."""
        ids = torch.cat(
            [batch_ids(args, sender, world, index)[mine] for sender in range(world)], 1
        ).view(len(mine), -1, args.ids_per_bag)
        if args.plan == "table_wise":
            return SparseFeatures(
                keys,
                ids.flatten(),
                torch.full((ids.numel() // args.ids_per_bag,), args.ids_per_bag),
            )
        held = (ids >= lo) & (ids < hi)
        return SparseFeatures(keys, ids[held] - lo, held.sum(2).flatten())

    routed = [routed_here(index) for index in range(args.warmup + args.steps)]
    looked_up = torch.tensor([routed[0].values.numel()])
    dist.all_reduce(looked_up)  # every id of step 0, over both ranks: the whole batch's

    def step(index: int) -> None:
        batch_ids(args, rank, world, index)  # drawn as in the sharded step, whose ids are routed
        pooled = emb(routed[index]).values  # (world * local batch, dims of this rank's tables)
        if args.plan == "row_wise":  # partial sums of every rank's bags: the reduce-scatter's input
            pooled = pooled.view(world, bags_per_rank, -1).sum(0)
        pooled.square().mean().backward()

    write_result(
        args,
        "local",
        time_steps(step, args),
        init_s,
        sharding=args.plan,
        ids_looked_up=looked_up.item(),
    )
    dist.destroy_process_group()


def worker_baseline(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from embedding_workload import batch_ids, local_batch, max_over_ranks, time_steps, write_result
    from torch import nn

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = local_batch(args, world)
    count = batch * args.ids_per_bag
    strategy_rows = [args.rows * r // world for r in range(world + 1)]
    dist.barrier()
    started = time.perf_counter()
    if args.plan == "table_wise":
        owner = [i * world // args.tables for i in range(args.tables)]
        mine = [t for t in range(args.tables) if owner[t] == rank]
        bags = nn.ModuleList(
            nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True) for _ in mine
        )
    else:
        lo, hi = strategy_rows[rank], strategy_rows[rank + 1]
        bags = nn.ModuleList(
            nn.EmbeddingBag(hi - lo, args.dim, mode="sum", sparse=True) for _ in range(args.tables)
        )
    for bag in bags:
        nn.init.uniform_(bag.weight, -(args.rows**-0.5), args.rows**-0.5)
    optimizer = torch.optim.Adagrad(bags.parameters(), lr=args.lr, eps=1e-8)
    init_s = max_over_ranks(time.perf_counter() - started)

    class AllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor, send, receive):  # type: ignore[override]
            ctx.send, ctx.receive = send, receive
            out = tensor.new_empty(sum(receive))
            dist.all_to_all_single(out, tensor, receive, send)
            return out

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            out = grad.new_empty(sum(ctx.send))
            dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive)
            return out, None, None

    offsets = torch.arange(0, world * count, args.ids_per_bag)

    def step(index: int) -> None:
        ids = batch_ids(args, rank, world, index)
        if args.plan == "table_wise":
            send_ids = torch.cat(
                [
                    ids[[t for t in range(args.tables) if owner[t] == d]].flatten()
                    for d in range(world)
                ]
            )
            sizes = [count * owner.count(d) for d in range(world)]
            got = torch.empty(len(mine) * count * world, dtype=torch.int64)
            dist.all_to_all_single(got, send_ids, [len(mine) * count] * world, sizes)
            got = got.view(world, len(mine), count)
            pooled = [bags[k](got[:, k].flatten(), offsets) for k in range(len(mine))]
            send = torch.stack(pooled, 1).view(world, len(mine), batch, args.dim).flatten()
            out = AllToAll.apply(
                send,
                [len(mine) * batch * args.dim] * world,
                [owner.count(d) * batch * args.dim for d in range(world)],
            )
        else:
            got = torch.empty(world * args.tables * count, dtype=torch.int64)
            dist.all_to_all_single(got, ids.flatten().repeat(world))
            got = got.view(world, args.tables, count)
            lo, hi = strategy_rows[rank], strategy_rows[rank + 1]
            pooled = []
            for t in range(args.tables):
                local = got[:, t].flatten()
                mask = (local >= lo) & (local < hi)
                pooled.append(
                    bags[t](
                        (local - lo).clamp(0, hi - lo - 1), offsets, per_sample_weights=mask.float()
                    )
                )
            send = torch.stack(pooled, 1).view(world, args.tables, batch, args.dim).flatten()
            out = AllToAll.apply(
                send, [send.numel() // world] * world, [send.numel() // world] * world
            )
            out = out.view(world, -1).sum(0)
        out.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    write_result(args, "baseline", time_steps(step, args), init_s, sharding=args.plan)
    dist.destroy_process_group()


# --- orchestration -----------------------------------------------------------------------------
def launch(
    python: str, script: Path, extra: list[str], args: argparse.Namespace, plan: str, rows: int
) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(RANKS),
            str(script),
            *extra,
            "--plan",
            plan,
            "--tables",
            str(args.tables),
            "--rows",
            str(rows),
            "--dim",
            str(args.dim),
            "--batch",
            str(args.batch),
            "--ids-per-bag",
            str(args.ids_per_bag),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--lr",
            str(args.lr),
            "--result",
            result,
            "--lengths",
            args.lengths,
            *(["--sequence"] if args.sequence else []),
        ]
        # faulthandler: a rank that dies on a signal prints every thread's Python stack
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": str(HERE.parent.parent),
        }
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if not os.path.exists(result):
            raise RuntimeError(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
        if run.returncode:  # measured and written, then died on the way out: keep, but say so
            kept = _keep_stderr(run.stderr, args)
            print(
                f"  (exit code {run.returncode} after writing its result; its errors:)\n"
                + "\n".join(f"    {line[:160]}" for line in _error_lines(run.stderr))
                + (f"\n    (whole stderr with the ranks' stacks: {kept})" if kept else ""),
                flush=True,
            )
        return json.loads(Path(result).read_text())


def _keep_stderr(stderr: str, args: argparse.Namespace) -> Path | None:
    """A dying job's whole stderr beside the --json output (None without --json): the rare
    aborts at exit are not reproduced alone, so each one's stacks are worth keeping."""
    if not getattr(args, "json", None):
        return None
    folder = Path(args.json).parent
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{Path(args.json).stem}.failed-{time.strftime('%Y%m%d-%H%M%S')}.log"
    path.write_text(stderr)
    return path


def _error_lines(stderr: str, keep: int = 6) -> list[str]:
    """The lines of a failed job's stderr that say what failed (not torchrun's banners)."""
    marks = ("Error", "error", "Signal", "signal", "Traceback", "terminate", "Exception")
    lines = [line for line in stderr.splitlines() if any(m in line for m in marks)]
    return lines[-keep:] or stderr.strip().splitlines()[-keep:]


def variants(args: argparse.Namespace) -> dict[str, tuple[str, Path, list[str]]]:
    found = {
        "manualpar": (sys.executable, Path(__file__), ["--worker", "manualpar"]),
        "baseline": (sys.executable, Path(__file__), ["--worker", "baseline"]),
    }
    if args.peer_python:
        found["torchrec"] = (args.peer_python, HERE / "peer_torchrec.py", [])
    if args.skip_baseline or args.sequence or args.lengths != "fixed":  # it pools fixed bags
        del found["baseline"]
    if args.sequence and not args.skip_padded:  # the sequence exchange as it was: padded
        found["padded"] = (sys.executable, Path(__file__), ["--worker", "manualpar", "--padded"])
    if args.pipelined:
        found["pipelined"] = (
            sys.executable,
            Path(__file__),
            ["--worker", "manualpar", "--pipelined"],
        )
    if args.floor:
        found["local"] = (sys.executable, Path(__file__), ["--worker", "local"])
    if args.batch_tables:
        found["batched"] = (
            sys.executable,
            Path(__file__),
            ["--worker", "manualpar", "--batch-tables"],
        )
    return found


# --precision: (variant, manualpar or the peer, --dtype); the ratios it reports (mine, theirs)
PRECISION_VARIANTS = (
    ("manualpar fp16", "manualpar", "fp16"),
    ("torchrec fp16", "torchrec", "fp16"),
    ("manualpar bf16", "manualpar", "bf16"),
    ("torchrec fp32", "torchrec", "fp32"),
    ("manualpar fp32", "manualpar", "fp32"),
)
PRECISION_RATIOS = (
    ("manualpar fp16", "torchrec fp16"),
    ("manualpar bf16", "torchrec fp32"),
    ("manualpar fp16", "torchrec fp32"),
    ("manualpar fp32", "torchrec fp32"),
    ("manualpar bf16", "manualpar fp32"),
)


def precision(args: argparse.Namespace) -> dict:
    """Half tables against TorchRec's: every (variant, dtype) job of PRECISION_VARIANTS in a
    rotating order per repeat; per plan, the median over repeats of each pair's ratio of step
    time and of peak RSS per process."""
    if not args.peer_python:
        raise SystemExit("--precision compares with TorchRec: pass --peer-python")
    from memory_floor import Floors, describe

    found = variants(args)
    floors = Floors(RANKS)  # the host probed before the first job
    floor = {
        (plan, dtype): floors.of(args, plan=plan, dtype=dtype)
        for plan in args.plans
        for dtype in {dtype for _, _, dtype in PRECISION_VARIANTS}
    }
    jobs = [(plan, name) for plan in args.plans for name, _, _ in PRECISION_VARIANTS]
    runs: dict[str, dict[str, list[dict]]] = {plan: {} for plan in args.plans}
    for repeat in range(args.repeats):
        shift = repeat % len(jobs)
        for plan, name in jobs[shift:] + jobs[:shift]:
            _, kind, dtype = next(v for v in PRECISION_VARIANTS if v[0] == name)
            python, script, extra = found[kind]
            result = launch(python, script, [*extra, "--dtype", dtype], args, plan, args.rows)
            runs[plan].setdefault(name, []).append(result)
            print(
                f"repeat {repeat} {plan:<10} {name:<15} {result['ms_per_step']:7.1f} ms/step  "
                f"peak RSS {max(result['peak_rss_gb_per_rank']):.2f} GiB",
                flush=True,
            )
    summary: dict[str, dict] = {}
    for plan, by_name in runs.items():
        summary[plan] = {
            f"{mine} / {theirs}": {
                key: statistics.median(
                    value(a) / value(b) for a, b in zip(by_name[mine], by_name[theirs], strict=True)
                )
                for key, value in (
                    ("ms_per_step", lambda r: r["ms_per_step"]),
                    ("peak_rss", lambda r: max(r["peak_rss_gb_per_rank"])),
                )
            }
            for mine, theirs in PRECISION_RATIOS
        }
        summary[plan]["median_ms_per_step"] = {
            name: statistics.median(r["ms_per_step"] for r in results)
            for name, results in by_name.items()
        }
        summary[plan]["max_peak_rss_gb"] = {
            name: max(max(r["peak_rss_gb_per_rank"]) for r in results)
            for name, results in by_name.items()
        }
        dtype_of = {name: dtype for name, _, dtype in PRECISION_VARIANTS}
        summary[plan]["memory_floor"] = {d: f for (p, d), f in floor.items() if p == plan}
        summary[plan]["x_memory_floor"] = {
            name: ms / floor[plan, dtype_of[name]]["ms"]
            for name, ms in summary[plan]["median_ms_per_step"].items()
        }
        for dtype, one in summary[plan]["memory_floor"].items():
            print(f"{plan} {dtype}: {describe(one)}", flush=True)
        print(
            f"{plan}: step / memory floor: "
            + ", ".join(f"{n} {x:.1f}x" for n, x in summary[plan]["x_memory_floor"].items()),
            flush=True,
        )
    print(json.dumps(summary, indent=2))
    return {"summary": summary, "runs": runs}


def compare(args: argparse.Namespace) -> dict:
    from memory_floor import Floors, add_floor

    floors = Floors(RANKS)  # the host probed before the first job
    floor = {plan: floors.of(args, plan=plan) for plan in args.plans}
    runs: dict[str, dict[str, list[dict]]] = {}
    names = list(variants(args))
    for repeat in range(args.repeats):
        for plan in args.plans:
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for name in order:
                python, script, extra = variants(args)[name]
                result = launch(python, script, extra, args, plan, args.rows)
                runs.setdefault(plan, {}).setdefault(name, []).append(result)
                print(
                    f"repeat {repeat} {plan:<10} {name:<9} {result['ms_per_step']:7.1f} ms/step"
                    f" ({result['ms_per_step'] / floor[plan]['ms']:.1f}x the memory floor)"
                    f"  init {result['init_s']:5.2f} s  peak RSS "
                    f"{max(result['peak_rss_gb_per_rank']):.2f} GiB",
                    flush=True,
                )
    summary = {}
    for plan, by_name in runs.items():
        summary[plan] = {}
        for other in names[1:]:
            pairs = list(zip(by_name["manualpar"], by_name[other], strict=True))
            summary[plan][f"manualpar/{other}"] = {
                "ms_per_step": statistics.median(
                    a["ms_per_step"] / b["ms_per_step"] for a, b in pairs
                ),
                "peak_rss": statistics.median(
                    max(a["peak_rss_gb_per_rank"]) / max(b["peak_rss_gb_per_rank"])
                    for a, b in pairs
                ),
                "init_s": statistics.median(a["init_s"] / b["init_s"] for a, b in pairs),
                "pairs": len(pairs),
            }
        for mine, theirs in (
            ("batched", "torchrec"),
            ("local", "torchrec"),
            ("pipelined", "local"),
            ("pipelined", "torchrec"),
        ):
            if mine in by_name and theirs in by_name:  # the floor, the pipeline, the peer
                summary[plan][f"{mine}/{theirs}"] = {
                    "ms_per_step": statistics.median(
                        a["ms_per_step"] / b["ms_per_step"]
                        for a, b in zip(by_name[mine], by_name[theirs], strict=True)
                    )
                }
        summary[plan]["median_ms_per_step"] = {
            name: statistics.median(r["ms_per_step"] for r in results)
            for name, results in by_name.items()
        }
        floor_line = add_floor(summary[plan], floor[plan])
        peer = summary[plan].get("manualpar/torchrec", {}).get("ms_per_step")
        print(
            f"{plan}: " + (f"manualpar / TorchRec {peer:.3f}x; " if peer else "") + floor_line,
            flush=True,
        )
    print(json.dumps(summary, indent=2))
    return {"summary": summary, "runs": runs}


def scale(args: argparse.Namespace) -> dict:
    """manualpar (and TorchRec, given --peer-python) at 1, 4 and 16 GiB of tables, equal
    lookups; (size, variant) jobs interleave in a rotating order over `--repeats`. Each variant's
    step time is compared with its own at the first size (median per size), so a slowdown the
    machine causes shows in both."""
    from memory_floor import Floors, describe

    names = [name for name in variants(args) if name != "baseline"]
    sizes = list(args.scale_gib)
    floors = Floors(RANKS)  # the host probed before the first job
    floor = {gib: floors.of(args, plan=args.plans[0], rows=_scale_rows(args, gib)) for gib in sizes}
    for gib in sizes:
        print(f"{gib:>4} GiB tables: {describe(floor[gib])}", flush=True)
    jobs = [(gib, name) for gib in sizes for name in names]
    runs: dict[str, dict[float, list[dict]]] = {name: {gib: [] for gib in sizes} for name in names}
    for repeat in range(args.repeats):
        shift = repeat % len(jobs)
        for gib, name in jobs[shift:] + jobs[:shift]:
            python, script, extra = variants(args)[name]
            rows = _scale_rows(args, gib)
            result = launch(python, script, extra, args, args.plans[0], rows)
            runs[name][gib].append(result)
            tables_state = args.tables * rows * (args.dim * 4 + 4) / 2**30
            result["rss_bound_gb"] = tables_state / 2 + 0.5
            print(
                f"repeat {repeat} {gib:>4} GiB tables {name:<9}: {result['ms_per_step']:7.1f} "
                f"ms/step, peak RSS per rank {max(result['peak_rss_gb_per_rank']):.2f} GiB "
                f"(bound {result['rss_bound_gb']:.2f}), init {result['init_s']:.1f} s, "
                f"{result['ms_per_step'] / floor[gib]['ms']:.1f}x the memory floor",
                flush=True,
            )
    summaries = {name: _scale_summary(runs[name], sizes, floor) for name in names}
    summary = summaries["manualpar"]
    for name in names[1:]:  # torchrec and the no-exchange floor (--floor), each on its own
        summary[name] = summaries[name]
    print(json.dumps(summary, indent=2))
    return {
        "summary": summary,
        "runs": {f"{gib}GiB": r for gib, r in runs["manualpar"].items()},
        **{f"{name}_runs": {f"{gib}GiB": r for gib, r in runs[name].items()} for name in names[1:]},
    }


def _scale_rows(args: argparse.Namespace, gib: float) -> int:
    """Rows per table for `gib` GiB of float32 tables."""
    return int(gib * 2**30 / (args.tables * args.dim * 4))


def _scale_summary(runs: dict[float, list[dict]], sizes: list[float], floor: dict) -> dict:
    first = statistics.median(r["ms_per_step"] for r in runs[sizes[0]])
    summary = {}
    for gib, results in runs.items():
        median_ms = statistics.median(r["ms_per_step"] for r in results)
        summary[f"{gib}GiB"] = {
            "median_ms_per_step": median_ms,
            f"vs_{sizes[0]}GiB": median_ms / first,
            "max_peak_rss_gb": max(max(r["peak_rss_gb_per_rank"]) for r in results),
            "rss_bound_gb": results[0]["rss_bound_gb"],
            "median_init_s": statistics.median(r["init_s"] for r in results),
            "memory_floor": floor[gib],
            "x_memory_floor": median_ms / floor[gib]["ms"],
        }
    return summary


def main() -> None:
    from embedding_workload import LENGTHS, add_workload_args

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("manualpar", "baseline", "local"))
    if "--worker" in sys.argv:
        add_workload_args(parser)
        parser.add_argument("--padded", action="store_true", help=argparse.SUPPRESS)
        parser.add_argument("--pipelined", action="store_true", help=argparse.SUPPRESS)
        parser.add_argument("--batch-tables", action="store_true", help=argparse.SUPPRESS)
        args = parser.parse_args()
        {"manualpar": worker_manualpar, "baseline": worker_baseline, "local": worker_local}[
            args.worker
        ](args)
        return
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plans", nargs="+", default=["table_wise", "row_wise"])
    parser.add_argument("--peer-python", help="python of a venv where torchrec + fbgemm import")
    parser.add_argument(
        "--skip-baseline",
        action="store_true",
        help="leave out the plain-torch baseline (quicker runs against the peer)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also run manualpar's step with no exchanges (worker_local)",
    )
    parser.add_argument(
        "--pipelined",
        action="store_true",
        help="also run manualpar's step through TrainPipeline (the next batch's input dist ahead)",
    )
    parser.add_argument(
        "--batch-tables",
        action="store_true",
        help="also run manualpar's step with all tables in one kernel call per phase",
    )
    parser.add_argument("--scale", action="store_true", help="1 -> 4 -> 16 GiB of tables")
    parser.add_argument(
        "--sequence",
        action="store_true",
        help="unpooled tables (EmbeddingCollection against TorchRec's): manualpar and the peer",
    )
    parser.add_argument(
        "--skip-padded", action="store_true", help="--sequence without the padded exchange"
    )
    parser.add_argument(
        "--lengths",
        choices=LENGTHS,
        default="fixed",
        help="ids per bag: --ids-per-bag each, or uniform over 0 .. 2 x --ids-per-bag",
    )
    parser.add_argument(
        "--precision",
        action="store_true",
        help="half tables: manualpar fp16/bf16/fp32 against TorchRec FP16/FP32 (PRECISION_RATIOS)",
    )
    parser.add_argument("--scale-gib", type=float, nargs="+", default=[1, 4, 16])
    parser.add_argument("--json")
    for flag, default in (
        ("--tables", 8),
        ("--rows", 1_000_000),
        ("--dim", 64),
        ("--batch", 2048),
        ("--ids-per-bag", 20),
        ("--steps", 20),
        ("--warmup", 5),
    ):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    if args.sequence and (args.floor or args.scale or args.precision):
        raise SystemExit("--sequence compares manualpar with --peer-python only (no --floor, ...)")
    if args.lengths != "fixed" and args.floor:
        raise SystemExit("--floor routes fixed-length bags: leave it out with --lengths uniform")
    payload = scale(args) if args.scale else precision(args) if args.precision else compare(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), **payload}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
