"""Train the two-tower retrieval model, then fine-tune its MLPs with the tables frozen.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/two_tower/train.py --out runs/two_tower
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/two_tower/train.py --out runs/two_tower_finetune --finetune-from runs/two_tower

Runs as one process too. The Trainer clips the dense gradients (`--clip`), steps a cosine
schedule for the dense optimizer and for both tables' fused optimizers, checkpoints to
OUT/checkpoints and resumes from there when run again. `--finetune-from RUN` starts from RUN's
latest checkpoint (the model only), freezes the tables and trains the MLPs alone. At the end,
every item's vector goes into a row-wise sharded index and each validation user retrieves its 10
best items over all items (`top_k_items`, retrieval.py).
"""

from __future__ import annotations

import argparse

import torch
from data import RetrievalData
from model import TwoTower
from retrieval import item_index, precision_at
from torch.distributed.elastic.multiprocessing.errors import record

import manualpar as mp


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", default="runs/two_tower", help="run directory (checkpoints, metrics)")
    add("--steps", type=int, default=200, help="optimizer steps to reach")
    add("--batch", type=int, default=256, help="global batch size: the in-batch negatives")
    add("--users", type=int, default=20_000)
    add("--items", type=int, default=4_096)
    add("--clusters", type=int, default=16)
    add("--lr", type=float, default=3e-3, help="AdamW learning rate of the MLPs")
    add("--emb-lr", type=float, default=0.1, help="row-wise Adagrad learning rate of the tables")
    add("--clip", type=float, default=1.0, help="max global norm of the dense gradients")
    add("--finetune-from", default=None, help="a run directory: start from it, tables frozen")
    add("--log-every", type=int, default=10)
    add("--val-every", type=int, default=50)
    add("--seed", type=int, default=0)
    add("--no-progress", action="store_true", help="hide the progress bar")
    return parser.parse_args()


@record
def main() -> None:
    args = parse_args()
    strategy = mp.ManualParallelStrategy()
    say = print if strategy.is_global_zero else (lambda *a, **k: None)
    strategy.seed_everything(args.seed)
    data = RetrievalData(args.users, args.items, args.clusters, args.batch, seed=args.seed)
    with mp.empty_init():
        model = TwoTower(
            users=args.users,
            items=args.items,
            clusters=args.clusters,
            lr=args.lr,
            emb_lr=args.emb_lr,
            steps=args.steps,
            freeze_tables=args.finetune_from is not None,
            seed=args.seed,
        )
    model.setup(strategy)
    trainer = mp.Trainer(
        strategy,
        args.out,
        max_steps=args.steps,
        checkpoint_every=args.val_every,
        log_every=args.log_every,
        val_every=args.val_every,
        clip_grad_norm=args.clip,
        progress=not args.no_progress,
    )
    if args.finetune_from is not None and mp.latest_checkpoint(trainer.checkpoint_dir) is None:
        start = mp.latest_checkpoint(f"{args.finetune_from}/checkpoints")
        if start is None:
            raise SystemExit(f"--finetune-from {args.finetune_from}: no checkpoint in it")
        strategy.load_checkpoint(start, {"model": model})  # weights only: new optimizers
        say(f"fine-tuning from {start} with the tables frozen")
    before = model.validation_step(data.validation(0, strategy))
    trainer.fit(model, data.train, val_data=data.validation)
    model.eval()
    after = model.validation_step(data.validation(0, strategy))
    for name, values in (("before", before), ("after", after)):
        reduced = {
            k: strategy.all_reduce(torch.as_tensor(v), op="mean").item() for k, v in values.items()
        }
        loss, hit = reduced["loss"], reduced["cluster_hit"]
        say(f"{name}: validation loss {loss:.4f}, cluster hit rate {hit:.3f}")
    index = item_index(model, strategy)  # every item's vector, sharded row-wise
    precision = precision_at(model, index, data.validation(0, strategy), 10, strategy)
    say(
        f"retrieval over all {args.items} items: precision@10 {precision:.3f} of the user's "
        f"cluster (chance {1 / args.clusters:.3f})"
    )
    say(f"checkpoint {mp.latest_checkpoint(trainer.checkpoint_dir)}")
    strategy.teardown()


if __name__ == "__main__":
    main()
