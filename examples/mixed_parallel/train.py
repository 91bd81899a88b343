"""Train a small transformer LM: FSDP-sharded blocks, DDP embedding and head, the Trainer.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/mixed_parallel/train.py --out runs/mixed

`--mesh hsdp` shards the blocks over pairs of ranks and replicates them across pairs (HSDP);
`--mesh fsdp-tp` splits each block's MLP over pairs of ranks (tensor parallel) and shards the
blocks over the other dim (FSDP x TP), e.g. on 4 processes:

    python -m torch.distributed.run --standalone --nproc-per-node 4 \
        examples/mixed_parallel/train.py --out runs/mixed-tp --mesh fsdp-tp

Runs as one process too (`python examples/mixed_parallel/train.py`). The text is synthetic: a
fixed random second-order Markov chain (data.py), so the best possible loss is known. The
Trainer checkpoints to OUT/checkpoints, appends metrics to OUT/metrics.jsonl (with the loss on
a fixed evaluation batch every --val-every steps) and resumes from the latest checkpoint when
run again, on any number of processes: run it again with a larger --steps and another
--nproc-per-node to continue a run on another world size. reshard.py evaluates a checkpoint.
"""

from __future__ import annotations

import argparse
import time

import torch
from config import RunConfig
from model import MESHES
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor

import manualpar as mp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = RunConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", default="runs/mixed", help="run directory (config, checkpoints, metrics)")
    add("--steps", type=int, default=300, help="optimizer steps to reach")
    add(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        help="global batch of sequences (all ranks together)",
    )
    add(
        "--eval-batch-size",
        type=int,
        default=defaults.eval_batch_size,
        help="sequences in the fixed evaluation batch (all ranks together)",
    )
    add("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence")
    add("--vocab", type=int, default=defaults.vocab, help="vocabulary size of the chain")
    add("--width", type=int, default=defaults.width, help="model width")
    add("--depth", type=int, default=defaults.depth, help="transformer blocks")
    add("--heads", type=int, default=defaults.heads, help="attention heads")
    add("--lr", type=float, default=defaults.lr, help="Adam learning rate")
    add("--seed", type=int, default=defaults.seed, help="seeds the chain, the data and the init")
    add("--mesh", choices=MESHES, default="flat", help="flat fsdp, hsdp, or fsdp-tp (see above)")
    add("--val-every", type=int, default=50, help="evaluation loss every N steps")
    add("--checkpoint-every", type=int, default=100)
    add("--log-every", type=int, default=10)
    add("--no-progress", action="store_true", help="hide the progress bar")
    return parser.parse_args(argv)


def layout(model: torch.nn.Module) -> str:
    """Each part's wrapper and parameter count, and how much of it this rank holds."""
    lines = []
    for name in ("embed", "blocks", "head"):
        part = getattr(model, name)
        params = list(part.parameters())
        total = sum(p.numel() for p in params)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
        lines.append(
            f"  {name:6s} {type(part).__name__:24s} {total:9,} parameters, rank 0 holds {local:,}"
        )
    return "\n".join(lines)


@record
def main(argv: list[str] | None = None) -> None:
    """The command line; `argv` lets tests run it inside their own processes."""
    args = parse_args(argv)
    config = RunConfig(
        vocab=args.vocab,
        seq_len=args.seq_len,
        width=args.width,
        depth=args.depth,
        heads=args.heads,
        lr=args.lr,
        batch_size=args.batch_size,
        eval_batch_size=args.eval_batch_size,
        seed=args.seed,
        mesh=args.mesh,
    )
    if RunConfig.exists(args.out) and mp.latest_checkpoint(f"{args.out}/checkpoints"):
        changed = config.shape_changes(RunConfig.load(args.out))
        if changed:  # the checkpoint would not fit, or the task would change under the model
            raise SystemExit(
                f"{args.out} holds a run of another shape ({', '.join(changed)}); "
                "pass the same flags to resume it, or a new --out"
            )
    strategy = mp.ManualParallelStrategy()
    say = print if strategy.is_global_zero else (lambda *a, **k: None)
    strategy.seed_everything(args.seed)
    data = config.data()
    reference = data.entropies()
    say(
        f"data: order-2 Markov chain over {config.vocab} tokens; loss in nats/token: unigram "
        f"{reference.unigram:.3f}, previous token only {reference.first_order:.3f}, best "
        f"possible {reference.best:.3f} (entropy rate {reference.rate:.3f})"
    )
    with mp.empty_init():  # nothing allocated until setup
        model = config.model()
    model.setup(strategy)
    say(f"model on {strategy.world_size} process(es):\n{layout(model)}")
    if strategy.is_global_zero:
        config.save(args.out)
    trainer = mp.Trainer(
        strategy,
        args.out,
        max_steps=args.steps,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        val_every=args.val_every,
        progress=not args.no_progress,
    )
    resumed = mp.latest_checkpoint(trainer.checkpoint_dir)
    first = mp.read_manifest(resumed)["step"] if resumed is not None else 0
    if resumed is not None:
        say(
            f"resuming from {resumed} (saved on {mp.read_manifest(resumed)['world_size']} "
            f"process(es))"
        )
    started = time.perf_counter()
    ranks = model.data_ranks  # tp pairs read the same share of each batch
    trainer.fit(
        model,
        lambda step, _: data.train(step, ranks),
        val_data=lambda index, _: data.validation(index, ranks),
    )
    seconds = time.perf_counter() - started
    model.eval()
    final = model.validation_step(data.validation(0, ranks))
    steps = trainer.step - first
    if steps:
        say(
            f"trained steps {first}-{trainer.step} in {seconds:.1f} s ({steps / seconds:.1f} "
            f"steps/s, {config.batch_size} x {config.seq_len} tokens per step on "
            f"{strategy.world_size} process(es))"
        )
    else:
        say(f"already at step {first}: pass a larger --steps to train on, or a new --out")
    say(
        f"eval loss {final['loss']:.6f} at step {trainer.step} ({config.eval_batch_size} "
        f"sequences; best possible {reference.best:.3f})"
    )
    say(f"checkpoint {mp.latest_checkpoint(trainer.checkpoint_dir)}")
    strategy.teardown()


if __name__ == "__main__":
    main()
