"""Train a SASRec-style next-item model on MovieLens, evaluated as RecBole's benchmark is.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/movielens/train.py --out runs/movielens

MovieLens-100k is fetched once into ~/.cache/manualpar/movielens (or $MANUALPAR_DATA/movielens);
`--ratings PATH` reads a GroupLens file instead (u.data, ratings.dat, ratings.csv, *.inter).
The protocol (protocol.py) is RecBole's: leave one out by time, histories of at most 50 items,
full ranking over every item with seen items kept, HR/NDCG/MRR at 10 and 20 averaged over
users. The Trainer validates once an epoch, keeps the best checkpoint by validation NDCG@10 and
stops after `--patience` epochs without a better one; the test metrics are the best
checkpoint's. A popularity baseline is scored on the same targets. Runs as one process too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from batches import evaluation_batches, popularity_metrics, training_batches
from model import SASRec
from protocol import leave_one_out, training_windows, user_sequences
from torch.distributed.elastic.multiprocessing.errors import record

import manualpar as mp
from manualpar.data import fetch_movielens_100k, read_ratings

MONITOR = "val/ndcg@10"
SHOWN = ("hr@10", "ndcg@10", "mrr@10", "hr@20", "ndcg@20", "mrr@20")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", default="runs/movielens", help="run directory (checkpoints, metrics)")
    add("--ratings", default=None, help="a MovieLens ratings file (default: fetch ml-100k)")
    add("--epochs", type=int, default=300, help="at most this many epochs")
    add("--patience", type=int, default=10, help="epochs without a better validation NDCG@10")
    add("--batch", type=int, default=32, help="global batch of training windows")
    add("--eval-batch", type=int, default=512, help="users ranked at once per rank")
    add("--lr", type=float, default=1e-3, help="Adam, for the encoder and the item table")
    add("--dense", choices=("ddp", "fsdp"), default="ddp", help="how the encoder is parallel")
    add("--users", type=int, default=None, help="only the first N users (quick runs)")
    add("--seed", type=int, default=0)
    add("--json", default=None, help="write the metrics and times here")
    add("--no-progress", action="store_true", help="hide the progress bar")
    add("--no-pipeline", action="store_true", help="no batch ids sent ahead (the same numbers)")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    strategy = mp.ManualParallelStrategy()
    say = print if strategy.is_global_zero else (lambda *a, **k: None)
    strategy.seed_everything(args.seed)
    started = time.perf_counter()
    ratings = read_ratings(args.ratings or fetch_movielens_100k())
    sequences = user_sequences(ratings)
    if args.users is not None:
        sequences = type(sequences)(sequences.items[: args.users], sequences.item_tokens)
    split = leave_one_out(sequences)
    windows = training_windows(split.train)
    say(
        f"{ratings.source}: {len(ratings)} ratings, {sequences.num_users} users, "
        f"{sequences.num_items} items; {len(windows)} training windows"
    )
    with mp.empty_init():
        model = SASRec(sequences.num_items, lr=args.lr, dense=args.dense, seed=args.seed)
    model.setup(strategy)
    per_epoch = max(1, len(windows) // args.batch)
    valid, valid_batches = evaluation_batches(split.valid, args.eval_batch)
    test, test_batches = evaluation_batches(split.test, args.eval_batch)
    trainer = mp.Trainer(
        strategy,
        args.out,
        max_steps=args.epochs * per_epoch,
        checkpoint_every=per_epoch,
        log_every=per_epoch,
        val_every=per_epoch,
        # every rank has the same number of evaluation batches (the last ones short or empty)
        val_steps=max(valid_batches(strategy.world_size), test_batches(strategy.world_size)),
        early_stopping=mp.EarlyStopping(MONITOR, mode="max", patience=args.patience),
        best_checkpoints=mp.BestCheckpoints(MONITOR, mode="max", keep=1),
        progress=not args.no_progress,
        read_ahead=True,  # the batches draw from their own generators: exact
        pipeline=not args.no_pipeline,  # SASRec.prefetch: the next batch's ids sent ahead
    )
    trainer.fit(model, training_batches(windows, args.batch, args.seed), val_data=valid)
    trained = time.perf_counter() - started
    best = trainer.validate(model, valid, checkpoint="best")
    tested = trainer.validate(model, test, checkpoint="best")
    results = {
        "sasrec": {
            "valid": {k: best[f"val/{k}"] for k in SHOWN},
            "test": {k: tested[f"val/{k}"] for k in SHOWN},
            "best_epoch": _step_of(trainer.best_checkpoint) / per_epoch,
            "epochs": trainer.step / per_epoch,
            "train_wall_s": trained,
        },
        "popularity": {
            "valid": _shown(popularity_metrics(split.train, split.num_items, split.valid)),
            "test": _shown(popularity_metrics(split.train, split.num_items, split.test)),
        },
        "users": sequences.num_users,
        "items": sequences.num_items,
        "world_size": strategy.world_size,
        "args": vars(args),
    }
    say(_table(results))
    if args.json and strategy.is_global_zero:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
        say(f"wrote {args.json}")
    strategy.teardown()


def _step_of(checkpoint: Path | None) -> int:
    return mp.describe_checkpoint(checkpoint)["step"] if checkpoint is not None else 0


def _shown(metrics: dict[str, float]) -> dict[str, float]:
    return {k: metrics[k] for k in SHOWN}


def _table(results: dict) -> str:
    lines = [f"{'model':<12}{'split':<7}" + "".join(f"{k:>10}" for k in SHOWN)]
    for name in ("sasrec", "popularity"):
        for split in ("valid", "test"):
            values = results[name][split]
            lines.append(f"{name:<12}{split:<7}" + "".join(f"{values[k]:>10.4f}" for k in SHOWN))
    sasrec = results["sasrec"]
    lines.append(
        f"SASRec: {sasrec['epochs']:.0f} epochs in {sasrec['train_wall_s']:.0f} s, the best at "
        f"epoch {sasrec['best_epoch']:.0f}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
