"""Train a DLRM click model on Criteo-shaped data with sharded embedding tables.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/recsys/train.py

Runs as one process too (`python examples/recsys/train.py`). By default the data is synthetic
(Criteo's 13 dense and 26 categorical features, with a hidden signal to learn); `--criteo FILE`
streams Criteo logs (manualpar.data's CriteoStream) into raw-id tables. The Trainer checkpoints
to OUT/checkpoints, appends metrics to OUT/metrics.jsonl (validation AUC every --val-every
steps) and resumes from the latest checkpoint when run again; at the end the metrics are drawn
to OUT/metrics.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from data import RAW_ID_MODES, SyntheticCriteo, make_tables, raw_id_tables, table_rows
from model import DLRM, make_plan
from torch.distributed.elastic.multiprocessing.errors import record

import manualpar as mp
from manualpar.cli.plot import plot_metrics
from manualpar.data import BAD_LINE_POLICIES, BadLines, CriteoStream
from manualpar.embeddings import EmbeddingPlan, RowWiseAdagrad, ShardedEmbeddingBagCollection
from manualpar.embeddings.planning import DTYPE_NAMES, dtype_name, plan_tables, raw_ids_to_json


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", default="runs/recsys", help="run directory (checkpoints, metrics, plot)")
    add("--steps", type=int, default=1500, help="optimizer steps to reach")
    add("--batch", type=int, default=2048, help="global batch size (all ranks together)")
    add("--lr", type=float, default=3e-3, help="Adam learning rate of the MLPs")
    add("--emb-lr", type=float, default=0.05, help="row-wise Adagrad learning rate of the tables")
    add("--dim", type=int, default=16, help="embedding dimension")
    add(
        "--table-dtype",
        choices=tuple(DTYPE_NAMES),
        default="fp32",
        help="how the tables store rows; fp16/bf16 halve their memory (lookups and updates "
        "still compute in float32; bf16 rounds updates stochastically)",
    )
    add(
        "--wire-dtype",
        choices=("fp32", "bf16", "fp16", "fp8"),
        default="fp32",
        help="dtype the pooled outputs and their gradients travel in between ranks: fp16 "
        "sends pooled outputs in float16 and gradients in bfloat16, bf16 both in bfloat16, "
        "fp8 pooled outputs in float8_e4m3fn (half or a quarter of the bytes; the math stays "
        "float32)",
    )
    add("--bottom", default="64", help="bottom MLP hidden sizes, comma-separated")
    add("--top", default="128,64", help="top MLP hidden sizes, comma-separated")
    add("--interaction", choices=("dot", "cat"), default="dot")
    add(
        "--cardinalities",
        choices=("kaggle", "terabyte"),
        default="kaggle",
        help="which published table sizes to use",
    )
    add("--max-rows", type=int, default=100_000, help="cap on rows per table")
    add(
        "--huge",
        action="store_true",
        help="no cap: the full published table sizes (only this rank's shards are allocated)",
    )
    add(
        "--plan",
        default="auto",
        help="auto, table_wise, row_wise, or a JSON file written by EmbeddingPlan.to_json()",
    )
    add(
        "--memory-budget-gb",
        type=float,
        default=None,
        help="per-rank budget for the planner (default with --huge: 70%% of RAM per local rank)",
    )
    add(
        "--plan-only",
        type=int,
        metavar="WORLD_SIZE",
        default=None,
        help="write OUT/plan.json for WORLD_SIZE ranks, print it and exit (allocates nothing)",
    )
    add(
        "--mesh",
        default="1d",
        help="tables: 1d (sharded over all ranks), 2d (sharded per node, replicated across "
        "nodes) or RxS, e.g. 2x2",
    )
    add("--val-every", type=int, default=100, help="validation AUC every N steps")
    add("--val-samples", type=int, default=8192, help="validation set size (all ranks)")
    add("--checkpoint-every", type=int, default=500)
    add("--log-every", type=int, default=20)
    add("--seed", type=int, default=0)
    add(
        "--criteo",
        nargs="+",
        metavar="FILE",
        help="train on Criteo-format files (plain or .gz), streamed into raw-id tables (--raw-ids)",
    )
    add(
        "--criteo-val",
        nargs="+",
        metavar="FILE",
        help="validation: the first --val-samples lines of these files (default: of the first "
        "--criteo file, which training then skips)",
    )
    add("--criteo-epochs", type=int, default=1, help="passes over the --criteo files")
    add(
        "--criteo-bad-lines",
        choices=BAD_LINE_POLICIES,
        default="raise",
        help="a malformed --criteo/--criteo-val line: stop naming it (raise), or leave it out "
        "and count it (skip), up to --criteo-max-bad-share of the lines read (blank lines are "
        "always left out)",
    )
    add(
        "--criteo-max-bad-share",
        type=float,
        default=0.001,
        help="with --criteo-bad-lines skip: stop once more than this share of a rank's lines "
        "were malformed (checked from 10,000 lines on, and at the end of each file)",
    )
    add(
        "--raw-ids",
        choices=RAW_ID_MODES,
        default="hash",
        help="how --criteo tables map raw ids to rows: a salted hash, or managed collisions "
        "evicting the least recently (lru) or least often (lfu) seen id; the Trainer then logs "
        "collision and eviction rates",
    )
    add("--rows-per-table", type=int, default=None, help="every table gets this many rows")
    add("--no-progress", action="store_true", help="hide the progress bar")
    add("--no-plot", action="store_true", help="do not write metrics.png")
    add(
        "--fail-once-at-step",
        type=int,
        default=None,
        metavar="N",
        help="fault drill: rank 1 raises at step N once (OUT/failed_once marks it done), so a "
        "launcher with restarts resumes from the last checkpoint",
    )
    return parser.parse_args()


def memory_budget(args: argparse.Namespace, local_ranks: int) -> int | None:
    if args.memory_budget_gb is not None:
        return int(args.memory_budget_gb * 2**30)
    if not args.huge:
        return None
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(0.7 * ram / local_ranks)


def save_plan(plan: EmbeddingPlan, tables: list, out: str) -> Path:
    """OUT/plan.json: edit it and pass it back with --plan to place tables by hand; and
    OUT/tables.json, which `python -m manualpar plan --tables` reads to plan other jobs."""
    path = Path(out) / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.to_json() + "\n")
    configs = (
        json.dumps(
            {
                **dataclasses.asdict(table),
                "dtype": dtype_name(table.dtype),
                "raw_ids": raw_ids_to_json(table.raw_ids),
            }
        )
        for table in tables
    )
    (path.parent / "tables.json").write_text("[\n" + ",\n".join(configs) + "\n]\n")
    return path


def fail_once(data: Callable[[int, Any], Any], step: int, out: str) -> Callable[[int, Any], Any]:
    """`data` that makes rank 1 raise at `step` unless OUT/failed_once exists (it writes it
    first): the restarted attempt then trains through, which is what a restart drill needs."""
    marker = Path(out) / "failed_once"

    def batch(index: int, strategy: Any) -> Any:
        if index == step and strategy.rank == 1 and not marker.exists():
            marker.write_text(f"rank 1 failed at step {step}\n")
            raise RuntimeError(f"injected failure on rank 1 at step {step} (--fail-once-at-step)")
        return data(index, strategy)

    return batch


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


@record
def main() -> None:
    args = parse_args()
    rows = table_rows(args.cardinalities, None if args.huge else args.max_rows)
    if args.rows_per_table is not None:
        rows = [args.rows_per_table] * len(rows)
    tables = make_tables(rows, args.dim, DTYPE_NAMES[args.table_dtype])
    if args.criteo:
        tables = raw_id_tables(tables, args.raw_ids)
    unsharded_gib = sum(t.num_bytes for t in tables) / 2**30
    if args.plan_only is not None:
        plan = make_plan(args.plan, tables, args.plan_only)
        if isinstance(plan, str):  # "auto"
            plan = plan_tables(
                tables,
                args.plan_only,
                memory_budget_bytes=memory_budget(args, 1),
                rule=RowWiseAdagrad(lr=args.emb_lr),
            )
        print(plan.describe(tables))
        print(
            f"tables: {sum(rows):,} rows, {unsharded_gib:.2f} GiB of {args.table_dtype} "
            "weights unsharded"
        )
        print(f"plan {save_plan(plan, tables, args.out)}")
        return
    strategy = mp.ManualParallelStrategy()
    say = print if strategy.is_global_zero else (lambda *a, **k: None)
    strategy.seed_everything(args.seed)
    with mp.empty_init():  # nothing allocated: tables may be far larger than one process's RAM
        model = DLRM(
            tables,
            bottom=[int(s) for s in args.bottom.split(",")],
            top=[int(s) for s in args.top.split(",")],
            interaction=args.interaction,
            plan=args.plan,
            emb_lr=args.emb_lr,
            lr=args.lr,
            seed=args.seed,
            memory_budget_bytes=memory_budget(args, strategy.environment.local_world_size),
            mesh=args.mesh,
            wire_dtype=args.wire_dtype,
        )
    model.setup(strategy)
    sharded = model.embeddings
    assert isinstance(sharded, ShardedEmbeddingBagCollection)  # (setup shards it)
    say(sharded.plan.describe(tables))
    if strategy.is_global_zero:
        say(f"plan {save_plan(sharded.plan, tables, args.out)}")
    local_gib = sum(p.numel() * p.element_size() for p in model.embeddings.parameters()) / 2**30
    say(
        f"tables: {sum(rows):,} rows, {unsharded_gib:.2f} GiB unsharded (never allocated); "
        f"rank 0 holds {local_gib:.3f} GiB of them"
    )
    data: CriteoStream | SyntheticCriteo
    if args.criteo:
        data = CriteoStream(
            args.criteo,
            rank=strategy.rank,
            world=strategy.world_size,
            batch_size=args.batch,
            val_samples=args.val_samples,
            val_files=args.criteo_val or (),
            epochs=args.criteo_epochs,
            bad_lines=BadLines(args.criteo_bad_lines, max_share=args.criteo_max_bad_share),
        )
    else:
        data = SyntheticCriteo(
            rows, seed=args.seed, batch_size=args.batch, val_samples=args.val_samples
        )
    trainer = mp.Trainer(
        strategy,
        args.out,
        max_steps=args.steps,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        val_every=args.val_every,
        val_steps=1,
        progress=not args.no_progress,
    )
    resumed = mp.latest_checkpoint(trainer.checkpoint_dir)
    first = mp.read_manifest(resumed)["step"] if resumed is not None else 0
    if resumed is not None:
        say(f"resuming from {resumed}")
    started = time.perf_counter()
    train: Callable[[int, Any], Any] = data.train
    if args.fail_once_at_step is not None:
        train = fail_once(train, args.fail_once_at_step, args.out)
    trainer.fit(model, train, val_data=data.validation)
    seconds = time.perf_counter() - started
    model.eval()
    final = model.validation_step(data.validation(0, strategy))
    peak = strategy.all_reduce(torch.tensor(peak_rss_gib()), op="max").item()
    steps = trainer.step - first
    if steps:
        say(
            f"trained steps {first}-{trainer.step} in {seconds:.1f} s ({steps / seconds:.1f} "
            f"steps/s, {args.batch} samples per step on {strategy.world_size} ranks); peak "
            f"memory per rank {peak:.2f} GiB"
        )
    else:
        say(f"already at step {first}: pass a larger --steps to train on, or a new --out")
    say(
        f"validation AUC {final['auc']:.4f}, log loss {final['loss']:.4f} "
        f"({args.val_samples} samples)"
    )
    if isinstance(data, CriteoStream) and args.criteo_bad_lines == "skip":  # (--criteo)
        counts = torch.tensor([data.bad_lines.skipped, data.bad_lines.lines], dtype=torch.float64)
        skipped, read = (int(n) for n in strategy.all_reduce(counts, op="sum").tolist())
        say(f"criteo: skipped {skipped} malformed lines of {read} read (all ranks)")
    say(f"checkpoint {mp.latest_checkpoint(trainer.checkpoint_dir)}")
    if strategy.is_global_zero and not args.no_plot:
        say(f"plot {plot_metrics(args.out)}")
    strategy.teardown()


if __name__ == "__main__":
    main()
