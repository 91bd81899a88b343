"""Train a DCN-v2 click model on Criteo-format files, one embedding table on disk.

    python examples/dcn/train.py --criteo day_0 day_1 --criteo-val val --processes 2

`--processes 2` starts 2 local workers itself (the script re-runs under torchrun;
`--restarts` restarts them after a failure); under torchrun, SLURM or MPI leave it out. The
26 categorical features are hashed into tables of `--rows-per-table` rows, except
`--disk-table`, which has `--disk-rows` rows in files under OUT/tables with `--cache-rows` of
them in memory per rank. The Trainer checkpoints to OUT/checkpoints, records metrics
(validation AUC, log loss, normalized entropy, calibration) in OUT/metrics.jsonl and resumes
when run again.
`examples/dcn/score.py` scores the validation set with the last checkpoint on one process.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from model import DCN
from torch.distributed.elastic.multiprocessing.errors import record

import manualpar as mp
from manualpar.data import CRITEO_FEATURES, CriteoStream
from manualpar.embeddings import EmbeddingBagConfig, HashIds, ShardedEmbeddingBagCollection

METRICS = ("auc", "log_loss", "normalized_entropy", "calibration")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--criteo", nargs="+", required=True, metavar="FILE", help="training files (or .gz)")
    add("--criteo-val", nargs="+", metavar="FILE", help="validation files (default: the first "
        "--val-samples lines of the first --criteo file, which training then skips)")  # fmt: skip
    add("--out", default="runs/dcn", help="run directory (checkpoints, metrics, disk tables)")
    add("--steps", type=int, default=200, help="optimizer steps to reach")
    add("--batch", type=int, default=512, help="global batch size (all ranks together)")
    add("--val-samples", type=int, default=4096, help="validation set size (all ranks)")
    add("--val-every", type=int, default=50)
    add("--checkpoint-every", type=int, default=50)
    add("--log-every", type=int, default=25)
    add("--dim", type=int, default=16, help="embedding dimension")
    add("--rows-per-table", type=int, default=4096, help="rows of each in-memory table")
    add("--disk-table", default="cat_2", help="the table kept in files on disk")
    add("--disk-rows", type=int, default=131_072, help="rows of the disk table")
    add("--cache-rows", type=int, default=4096, help="disk-table rows cached per rank")
    add("--bottom", default="64", help="bottom MLP hidden sizes, comma-separated")
    add("--cross-layers", type=int, default=2)
    add("--cross-rank", type=int, default=None, help="low-rank cross layers (default: full)")
    add("--top", default="128,64", help="top MLP hidden sizes, comma-separated")
    add("--lr", type=float, default=1e-3, help="Adam learning rate of the dense parts")
    add("--emb-lr", type=float, default=0.05, help="row-wise Adagrad rate of the tables")
    add(
        "--wire-dtype",
        choices=("fp32", "bf16", "fp16", "fp8"),
        default="fp32",
        help="dtype the pooled outputs and their gradients travel in between ranks: fp16 "
        "sends pooled outputs in float16 and gradients in bfloat16, bf16 both in bfloat16, "
        "fp8 pooled outputs in float8_e4m3fn (half or a quarter of the bytes; the math stays "
        "float32)",
    )
    add("--seed", type=int, default=0)
    add("--processes", type=int, default=None, help="start this many local workers")
    add("--restarts", type=int, default=0, help="with --processes: restarts after a failure")
    add("--no-progress", action="store_true", help="hide the progress bar")
    add("--kill-rank-at-step", type=int, default=None, metavar="N", help="fault drill: rank 1 "
        "SIGKILLs itself when it reads batch N, on the first attempt only")  # fmt: skip
    return parser.parse_args(argv)


def make_tables(args: argparse.Namespace) -> list[EmbeddingBagConfig]:
    """One table per categorical feature, raw ids hashed into its rows (salt: its position)."""
    return [
        EmbeddingBagConfig(
            name,
            num_embeddings=args.disk_rows if name == args.disk_table else args.rows_per_table,
            embedding_dim=args.dim,
            raw_ids=HashIds(salt=index),
        )
        for index, name in enumerate(CRITEO_FEATURES)
    ]


def build(args: argparse.Namespace, tier_dir: str) -> DCN:
    """The model as declared (call under mp.empty_init()); score.py builds the same one."""
    return DCN(
        make_tables(args),
        tier_dir=tier_dir,
        disk_table=args.disk_table,
        cache_rows=args.cache_rows,
        bottom=[int(s) for s in args.bottom.split(",")],
        cross_layers=args.cross_layers,
        cross_rank=args.cross_rank,
        top=[int(s) for s in args.top.split(",")],
        emb_lr=args.emb_lr,
        lr=args.lr,
        seed=args.seed,
        wire_dtype=args.wire_dtype,
    )


def criteo_data(args: argparse.Namespace, strategy: mp.ManualParallelStrategy) -> CriteoStream:
    return CriteoStream(
        args.criteo,
        rank=strategy.rank,
        world=strategy.world_size,
        batch_size=args.batch,
        val_samples=args.val_samples,
        val_files=args.criteo_val or (),
    )


def kill_once(data: Callable[[int, Any], Any], step: int) -> Callable[[int, Any], Any]:
    """`data` whose rank 1 dies by SIGKILL when asked for batch `step` on the first attempt (a
    restarted worker has restart_count 1): what a lost machine looks like to the job."""

    def batch(index: int, strategy: mp.ManualParallelStrategy) -> Any:
        if index == step and strategy.rank == 1 and strategy.environment.restart_count == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return data(index, strategy)

    return batch


@record
def main() -> None:
    args = parse_args()
    if args.processes is not None:  # a plain `python train.py` re-runs itself under torchrun here
        strategy = mp.ManualParallelStrategy(
            num_processes=args.processes, max_restarts=args.restarts
        )
    else:
        strategy = mp.ManualParallelStrategy()
    say = print if strategy.is_global_zero else (lambda *a, **k: None)
    strategy.seed_everything(args.seed)
    with mp.empty_init():
        model = build(args, os.path.join(args.out, "tables"))
    model.setup(strategy)
    sharded = model.embeddings
    assert isinstance(sharded, ShardedEmbeddingBagCollection)  # (setup shards it)
    say(sharded.plan.describe(model.tables), flush=True)
    data = criteo_data(args, strategy)
    trainer = mp.Trainer(
        strategy,
        args.out,
        max_steps=args.steps,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        val_every=args.val_every,
        progress=not args.no_progress,
    )
    train = (
        data.train
        if args.kill_rank_at_step is None
        else kill_once(data.train, args.kill_rank_at_step)
    )
    started = time.perf_counter()
    final = trainer.fit(model, train, val_data=data.validation)
    seconds = time.perf_counter() - started
    restarts = strategy.environment.restart_count
    say(
        f"trained to step {trainer.step} in {seconds:.1f} s on {strategy.world_size} ranks "
        f"({args.batch} samples per step); restarts: {restarts}"
    )
    say(
        "validation "
        + ", ".join(f"{k} {final[f'val/{k}']:.4f}" for k in METRICS if f"val/{k}" in final)
    )
    say(f"checkpoint {mp.latest_checkpoint(trainer.checkpoint_dir)}")
    strategy.teardown()


if __name__ == "__main__":
    main()
