"""Score the validation set with a DCN run's last checkpoint, on one process.

    python examples/dcn/score.py --criteo day_0 day_1 --criteo-val val --out runs/dcn

Takes the same model and data flags as train.py (the model is rebuilt from them), loads the
latest checkpoint of OUT (written by any number of ranks), scores the validation samples with
`Trainer.predict` and prints the click metrics beside those of the run's last validation pass
(OUT/metrics.jsonl): they are equal bit for bit. `--scores FILE` also saves each sample's logit.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from train import METRICS, build, criteo_data, parse_args

import manualpar as mp
from manualpar.metrics import CTRMetrics


def last_validation(out: str) -> dict[str, float]:
    """The run's last record of validation metrics in OUT/metrics.jsonl."""
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "val/auc" in r]
    if not records:
        raise SystemExit(f"{out}/metrics.jsonl holds no validation record: train first")
    return records[-1]


def main() -> None:
    scores_path = None
    if "--scores" in sys.argv:  # this script's own flag; the rest are train.py's
        at = sys.argv.index("--scores")
        scores_path = sys.argv[at + 1]
        del sys.argv[at : at + 2]
    args = parse_args()
    strategy = mp.ManualParallelStrategy()
    if strategy.world_size != 1:
        raise SystemExit("score.py runs as one process: python examples/dcn/score.py ...")
    data = criteo_data(args, strategy)
    with tempfile.TemporaryDirectory() as tier_dir:  # the disk table's files while scoring
        with mp.empty_init():
            model = build(args, tier_dir)
        trainer = mp.Trainer(strategy, args.out, max_steps=1, progress=False)
        batches = trainer.predict(model, data.validation, steps=1, checkpoint="latest")
        logits = torch.cat(list(batches))
    labels = data.validation(0, strategy).labels
    metric = CTRMetrics()
    metric.update(logits, labels)
    scored, recorded = metric.compute(), last_validation(args.out)
    print(f"scored {len(logits)} samples with {mp.latest_checkpoint(trainer.checkpoint_dir)}")
    for name in (*METRICS, "count"):
        same = "equal" if scored[name] == recorded[f"val/{name}"] else "DIFFERENT"
        print(f"{name:<20} {scored[name]!r:<22} validation {recorded[f'val/{name}']!r}  {same}")
    if scores_path is not None:
        torch.save(logits, scores_path)


if __name__ == "__main__":
    main()
