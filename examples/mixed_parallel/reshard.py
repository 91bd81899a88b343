"""Load a train.py checkpoint on any number of processes and evaluate it on the fixed batch.

    python examples/mixed_parallel/reshard.py runs/mixed          # 1 process: nothing sharded
    python -m torch.distributed.run --standalone --nproc-per-node 3 \
        examples/mixed_parallel/reshard.py runs/mixed              # 3 processes

The checkpoint holds FSDP shards of the blocks (DTensors) and the DDP parts' full tensors;
strategy.load_checkpoint reshards them to this world size (here through mp.load_trained, which
builds the model on meta and runs its setup first). The evaluation batch is split over the
ranks and its loss summed over all of them, so the value equals the one the training run
recorded at that step, up to float rounding. To continue training on another world size, run
train.py again with a larger --steps: the Trainer resumes from the same checkpoints.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from config import RunConfig
from torch.distributed.elastic.multiprocessing.errors import record
from train import layout

import manualpar as mp


def recorded_eval_loss(out: Path, step: int) -> float | None:
    """The evaluation loss the training run appended to metrics.jsonl at `step`, if any."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("step") == step and "val/loss" in record:
            found = float(record["val/loss"])
    return found


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the --out directory of a train.py run")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint directory (default: the latest under OUT/checkpoints)")
    args = parser.parse_args()
    config = RunConfig.load(args.out)
    path = args.checkpoint or mp.latest_checkpoint(args.out / "checkpoints")
    if path is None:
        raise SystemExit(f"no checkpoint under {args.out / 'checkpoints'}")
    manifest = mp.read_manifest(path)
    strategy = mp.ManualParallelStrategy()
    say = print if strategy.is_global_zero else (lambda *a, **k: None)
    model = mp.load_trained(config.model, strategy, path)
    say(f"loaded {path} (saved on {manifest['world_size']} process(es), step "
        f"{manifest['step']}) on {strategy.world_size} process(es):\n{layout(model)}")
    model.eval()
    loss = model.validation_step(config.data().validation(0, strategy))["loss"]
    say(f"eval loss {loss:.6f} at step {manifest['step']} on {strategy.world_size} process(es)")
    recorded = recorded_eval_loss(args.out, manifest["step"])
    if recorded is not None:
        say(f"recorded by the training run: {recorded:.6f} (relative difference "
            f"{abs(loss - recorded) / recorded:.1e})")
    strategy.teardown()


if __name__ == "__main__":
    main()
