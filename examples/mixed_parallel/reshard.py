"""Load a train.py checkpoint on any number of processes and evaluate it on the fixed batch.

    python examples/mixed_parallel/reshard.py runs/mixed          # 1 process: nothing sharded
    python -m torch.distributed.run --standalone --nproc-per-node 3 \\
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
from dataclasses import dataclass
from pathlib import Path

from config import RunConfig
from torch.distributed.elastic.multiprocessing.errors import record
from train import layout

import manualpar as mp


@dataclass(frozen=True)
class Evaluation:
    checkpoint: Path
    step: int
    saved_world_size: int
    world_size: int
    loss: float  # on the fixed evaluation batch, here
    recorded: float | None  # what the training run recorded at that step, if it did
    layout: str


def recorded_eval_loss(out: Path, step: int) -> float | None:
    """The evaluation loss the training run appended to metrics.jsonl at `step`, if any."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        entry = json.loads(line) if line.strip() else {}
        if entry.get("step") == step and "val/loss" in entry:
            found = float(entry["val/loss"])
    return found


def evaluate(
    strategy: mp.ManualParallelStrategy, out: Path, checkpoint: Path | None = None
) -> Evaluation:
    """Load `checkpoint` (default: the run's latest) on this world size; evaluate (collective)."""
    config = RunConfig.load(out)
    path = checkpoint or mp.latest_checkpoint(out / "checkpoints")
    if path is None:
        raise FileNotFoundError(f"no checkpoint under {out / 'checkpoints'}")
    manifest = mp.read_manifest(path)
    model = mp.load_trained(config.model, strategy, path)  # a TinyLM, as config.model builds
    model.eval()
    loss = model.validation_step(config.data().validation(0, strategy))["loss"]
    return Evaluation(
        Path(path),
        manifest["step"],
        manifest["world_size"],
        strategy.world_size,
        loss,
        recorded_eval_loss(out, manifest["step"]),
        layout(model),
    )


@record
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the --out directory of a train.py run")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="a checkpoint directory (default: the latest under OUT/checkpoints)",
    )
    args = parser.parse_args()
    strategy = mp.ManualParallelStrategy()
    result = evaluate(strategy, args.out, args.checkpoint)
    if strategy.is_global_zero:
        print(
            f"loaded {result.checkpoint} (saved on {result.saved_world_size} process(es), "
            f"step {result.step}) on {result.world_size} process(es):\n{result.layout}"
        )
        print(
            f"eval loss {result.loss:.6f} at step {result.step} on {result.world_size} process(es)"
        )
        if result.recorded is not None:
            difference = abs(result.loss - result.recorded) / result.recorded
            print(
                f"recorded by the training run: {result.recorded:.6f} (relative difference "
                f"{difference:.1e})"
            )
    strategy.teardown()


if __name__ == "__main__":
    main()
