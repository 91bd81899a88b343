"""A deduplicated user feature (a batch per feature) against the expanded batch it stands for.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/benchmarks/bench_variable_batch.py --json runs/bench_variable_batch.json

Each request holds `--per-user` item rows (8) of one user: the item tables (`--tables`, one id
per bag, `--item-ids`) see one bag per row, the user table one bag per request
(`--user-ids` ids of history, 50), which the expanded batch repeats for each of its rows. The
same sharded tables (row-wise Adagrad, placed by `--plan`) train in the same processes on the
variable batch (each user bag sent and looked up once, its pooled row expanded after the
exchange; step/bag_expansion.py) and on the expanded one, in alternating order per repeat
(paired_steps.py): the median ratio of their step times, and the bytes each sends and
receives per step through the step's all_to_alls (counted at the strategy, every rank summed).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import cycling_step, write_json
from paired_steps import compare, parse_args

import manualpar as mp
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    table_wise,
)


def own_options() -> dict[str, int]:
    """--per-user, --user-ids and --item-ids, taken out of argv (paired_steps' parser knows
    the rest)."""
    options = {"per_user": 8, "user_ids": 50, "item_ids": 1}
    for name in list(options):
        flag = "--" + name.replace("_", "-")
        if flag in sys.argv:
            at = sys.argv.index(flag)
            options[name] = int(sys.argv[at + 1])
            del sys.argv[at : at + 2]
    return options


def build(args: argparse.Namespace, strategy: mp.ManualParallelStrategy) -> Any:
    """A user table and `--tables` item tables, placed by `--plan`."""
    configs = [EmbeddingBagConfig("user", args.rows, args.dim)] + [
        EmbeddingBagConfig(f"t{i}", args.rows, args.dim) for i in range(args.tables)
    ]
    world = strategy.world_size
    place = (lambda i: table_wise(i % world)) if args.plan == "table_wise" else lambda i: row_wise()
    plan = EmbeddingPlan(world, {c.name: place(i) for i, c in enumerate(configs)})
    with mp.empty_init():
        ebc = EmbeddingBagCollection(configs, seed=0)
    return shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=args.lr))


def batches(
    args: argparse.Namespace, options: dict[str, int], strategy: mp.ManualParallelStrategy
) -> list[SparseFeatures]:
    """This rank's variable batches: a user bag per `per_user` rows, the item bags per row."""
    rank, count = strategy.rank, args.warmup + args.steps
    rows = args.batch // strategy.world_size
    users = -(-rows // options["per_user"])
    out = []
    for step in range(count):
        generator = torch.Generator().manual_seed(1000 * rank + step)
        user_ids = torch.randint(0, args.rows, (users * options["user_ids"],), generator=generator)
        item_ids = args.tables * rows * options["item_ids"]
        items = torch.randint(0, args.rows, (item_ids,), generator=generator)
        lengths = torch.cat(
            [
                torch.full((users,), options["user_ids"]),
                torch.full((args.tables * rows,), options["item_ids"]),
            ]
        )
        inverse = torch.cat(
            [
                (torch.arange(rows) // options["per_user"]).unsqueeze(0),
                torch.arange(rows).repeat(args.tables, 1),
            ]
        )
        out.append(
            SparseFeatures(
                ("user", *(f"t{i}" for i in range(args.tables))),
                torch.cat([user_ids, items]),
                lengths,
                None,
                (users, *([rows] * args.tables)),
                inverse,
            )
        )
    return out


def exchanged_bytes(
    strategy: mp.ManualParallelStrategy, step: Callable[[], None]
) -> dict[str, int]:
    """Bytes one step sends and receives through all_to_all (summed over the ranks)."""
    counted = torch.zeros(2, dtype=torch.float64)
    plain, started = strategy.all_to_all, strategy.all_to_all_async

    def count(tensor: torch.Tensor, send: list[int], receive: list[int]) -> None:
        own = strategy.rank if len(send) == strategy.world_size else None
        counted[0] += sum(n for r, n in enumerate(send) if r != own) * tensor.element_size()
        counted[1] += sum(n for r, n in enumerate(receive) if r != own) * tensor.element_size()

    def counting(call: Callable[..., Any]) -> Callable[..., Any]:
        def run(tensor: torch.Tensor, send: list[int], receive: list[int], **kw: Any) -> Any:
            count(tensor, send, receive)
            return call(tensor, send, receive, **kw)

        return run

    strategy.all_to_all, strategy.all_to_all_async = counting(plain), counting(started)  # type: ignore[method-assign]
    try:
        step()
    finally:
        strategy.all_to_all, strategy.all_to_all_async = plain, started  # type: ignore[method-assign]
    total = strategy.all_reduce(counted, op="sum")
    return {"sent": int(total[0]), "received": int(total[1])}


def main() -> None:
    options = own_options()
    args = parse_args(__doc__.splitlines()[0], plan="row_wise")
    torch.set_num_threads(1)
    strategy = mp.ManualParallelStrategy()
    variable = batches(args, options, strategy)
    data = {"expanded": [b.expand() for b in variable], "variable": variable}
    steps = {name: cycling_step(build(args, strategy), data[name]) for name in data}
    bytes_per_step = {name: exchanged_bytes(strategy, steps[name]) for name in steps}
    compare(args, strategy, steps)  # writes the times to --json
    if strategy.is_global_zero:
        for name, moved in bytes_per_step.items():
            print(f"{name}: {moved['sent']:,} bytes sent, {moved['received']:,} received a step")
        ratio = bytes_per_step["variable"]["sent"] / bytes_per_step["expanded"]["sent"]
        print(f"bytes ratio (variable / expanded) {ratio:.3f}", flush=True)
        if args.json:
            result = json.loads(Path(args.json).read_text())
            result["args"].update(options)
            write_json(
                args.json, {**result, "bytes_per_step": bytes_per_step, "bytes_ratio": ratio}
            )
    strategy.teardown()


if __name__ == "__main__":
    main()
