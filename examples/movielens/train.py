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

`--recipe windows` (the default) trains on one window per user with a loss at every position;
`--recipe recbole` on RecBole's samples, one per prefix with a loss at its last item, with
RecBole's batch (2048) and stopping rule (11 epochs without a better score) unless given.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from batches import evaluation_batches, popularity_metrics, prefix_batches, training_batches
from model import SASRec
from protocol import leave_one_out, prefix_samples, training_windows, user_sequences
from torch.distributed.elastic.multiprocessing.errors import record

import manualpar as mp
from manualpar.data import fetch_movielens_100k, read_ratings

MONITOR = "val/ndcg@10"
SHOWN = ("hr@10", "ndcg@10", "mrr@10", "hr@20", "ndcg@20", "mrr@20")
# recipe: (samples, batches, default global batch, default patience). RecBole's stopping_step 10
# ends a run once 11 validations in a row missed the best: patience 11 here. A windows epoch is
# 75 steps (RecBole's 380 at batch 256): with patience 10, one of 3 seeds stopped at epoch 18;
# with 20 it went on to a better best at epoch 31 (validation NDCG@10 0.0614 -> 0.0671).
RECIPES = {
    "windows": (training_windows, training_batches, 32, 20),
    "recbole": (prefix_samples, prefix_batches, 2048, 11),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", default="runs/movielens", help="run directory (checkpoints, metrics)")
    add("--ratings", default=None, help="a MovieLens ratings file (default: fetch ml-100k)")
    add("--epochs", type=int, default=300, help="at most this many epochs")
    add("--recipe", choices=tuple(RECIPES), default="windows", help="training samples")
    add("--patience", type=int, default=None, help="epochs without a better validation NDCG@10")
    add("--batch", type=int, default=None, help="global batch of training samples")
    add("--eval-batch", type=int, default=512, help="users ranked at once per rank")
    add("--lr", type=float, default=1e-3, help="Adam, for the encoder and the item table")
    add("--dense", choices=("ddp", "fsdp"), default="ddp", help="how the encoder is parallel")
    add("--users", type=int, default=None, help="only the first N users (quick runs)")
    add("--seed", type=int, default=0)
    add("--json", default=None, help="write the metrics and times here")
    add("--no-progress", action="store_true", help="hide the progress bar")
    add("--no-pipeline", action="store_true", help="no batch ids sent ahead (the same numbers)")
    args = parser.parse_args()
    _, _, batch, patience = RECIPES[args.recipe]
    args.batch = args.batch or batch
    args.patience = args.patience or patience
    return args


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
    samples_of, batches_of, _, _ = RECIPES[args.recipe]
    samples = samples_of(split.train)
    say(
        f"{ratings.source}: {len(ratings)} ratings, {sequences.num_users} users, "
        f"{sequences.num_items} items; {len(samples)} training samples ({args.recipe})"
    )
    with mp.empty_init():
        model = SASRec(sequences.num_items, lr=args.lr, dense=args.dense, seed=args.seed)
    model.setup(strategy)
    per_epoch = max(1, len(samples) // args.batch)
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
    clock = EpochClock(valid, say)
    trainer.fit(model, batches_of(samples, args.batch, args.seed), val_data=clock)
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
            **clock.summary(strategy),
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


class EpochClock:
    """The validation data, noting the wall and CPU clocks as each pass starts: an epoch's
    time is then its training plus the previous epoch's validation and checkpoint, as RecBole's
    epoch (train_s + valid_s) is counted beside it."""

    def __init__(self, data: Callable[[int, Any], Any], say: Callable[[str], None]) -> None:
        self.data, self.say = data, say
        self.marks = [(time.perf_counter(), time.process_time())]

    def __call__(self, index: int, strategy: Any) -> Any:
        if index == 0:
            self.marks.append((time.perf_counter(), time.process_time()))
            (wall0, cpu0), (wall, cpu) = self.marks[-2:]
            epoch = len(self.marks) - 1
            self.say(f"epoch {epoch}: {wall - wall0:.1f} s wall, {cpu - cpu0:.1f} s CPU (rank 0)")
        return self.data(index, strategy)

    def summary(self, strategy: mp.ManualParallelStrategy) -> dict[str, list[float]]:
        """Each epoch's wall seconds (rank 0) and CPU seconds summed over ranks."""
        wall = [round(b[0] - a[0], 3) for a, b in itertools.pairwise(self.marks)]
        cpu = torch.tensor([b[1] - a[1] for a, b in itertools.pairwise(self.marks)])
        cpu = strategy.all_reduce(cpu.double(), op="sum")
        return {"epoch_wall_s": wall, "epoch_cpu_s": [round(c, 3) for c in cpu.tolist()]}


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
