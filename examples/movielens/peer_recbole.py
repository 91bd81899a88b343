"""RecBole 1.2.1's SASRec on MovieLens-100k: the peer of the manualpar recommender beside it.

Runs from its own environment (`make recbole-peer` builds `.venv-recbole`) and never imports
manualpar; RecBole itself does the data handling, training, early stopping and evaluation, so the
numbers are what RecBole's sequential benchmark reports:

    .venv-recbole/bin/python examples/movielens/peer_recbole.py --seed 2020 \\
        --json runs/movielens/recbole-2020.json [--epochs 300] [--max-minutes 60] [--data FILE] \\
        [--batch 2048]

Protocol (RECBOLE_PROTOCOL.md has the source-level details): the .inter file unfiltered, each
user's interactions by time, leave-one-out (last item test, second-to-last validation), histories
of at most 50 items, full ranking over all items with seen items kept, Hit/NDCG/MRR @10 and @20,
early stopping on validation NDCG@10, test metrics of the best checkpoint. Before training it
checks that nothing was filtered and that RecBole's split is the leave-one-out by time that
RECBOLE_PROTOCOL.md describes, sample by sample.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# RecBole reloads its best checkpoint with a plain torch.load (a pickled Config inside), which
# torch >= 2.6 refuses under weights_only; the file is the one this run just wrote.
os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")


def _stand_in_for_ray() -> None:
    """recbole/__init__ imports quick_start, whose first lines do `from ray import tune`.

    Only hyper-parameter search uses it; an empty module lets `import recbole` work without
    installing ray (hundreds of MB) for a run that never calls it.
    """
    if importlib.util.find_spec("ray") is not None:
        return
    ray = types.ModuleType("ray")
    ray.tune = types.ModuleType("ray.tune")  # type: ignore[attr-defined]
    sys.modules["ray"] = ray
    sys.modules["ray.tune"] = ray.tune


_stand_in_for_ray()

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import recbole  # noqa: E402
import torch  # noqa: E402
from recbole.config import Config  # noqa: E402
from recbole.data import create_dataset, data_preparation  # noqa: E402
from recbole.data.dataloader import FullSortEvalDataLoader  # noqa: E402
from recbole.model.sequential_recommender import SASRec  # noqa: E402
from recbole.trainer import Trainer  # noqa: E402
from recbole.utils import init_logger, init_seed  # noqa: E402

PACKAGED_DATASET = "ml-100k"
METRICS = ["Hit", "NDCG", "MRR"]
TOPK = [10, 20]
MAX_LEN = 50

# RecBole's SASRec on its sequential benchmark. Every value that decides the protocol or the model
# is written out, even where it equals RecBole's default, so the JSON shows it and a changed
# default cannot slip in.
BASE_CONFIG: dict[str, Any] = {
    # data: as RecBole's own properties/dataset/ml-100k.yaml (columns, no filter, normalize_all)
    "field_separator": "\t",
    "USER_ID_FIELD": "user_id",
    "ITEM_ID_FIELD": "item_id",
    "RATING_FIELD": "rating",
    "TIME_FIELD": "timestamp",
    "load_col": {"inter": ["user_id", "item_id", "rating", "timestamp"]},
    "rm_dup_inter": None,
    "val_interval": None,
    "filter_inter_by_user_or_item": True,
    "user_inter_num_interval": None,
    "item_inter_num_interval": None,
    "normalize_all": True,
    "MAX_ITEM_LIST_LENGTH": MAX_LEN,
    # protocol
    "eval_args": {
        "split": {"LS": "valid_and_test"},
        "order": "TO",
        "group_by": "user",
        "mode": {"valid": "full", "test": "full"},
    },
    "repeatable": True,
    "metrics": METRICS,
    "topk": TOPK,
    "valid_metric": "NDCG@10",
    "metric_decimal_place": 4,
    "eval_step": 1,
    "stopping_step": 10,
    "train_batch_size": 2048,
    "eval_batch_size": 4096,
    # model: properties/model/SASRec.yaml
    "n_layers": 2,
    "n_heads": 2,
    "hidden_size": 64,
    "inner_size": 256,
    "hidden_dropout_prob": 0.5,
    "attn_dropout_prob": 0.5,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "initializer_range": 0.02,
    "loss_type": "CE",
    "train_neg_sample_args": None,
    # optimizer
    "learner": "adam",
    "learning_rate": 1e-3,
    "weight_decay": 0.0,
    # machine
    "use_gpu": False,
    "gpu_id": "",
    "worker": 0,
    "reproducibility": True,
    "shuffle": True,
    "show_progress": False,
    "log_wandb": False,
    "save_dataset": False,
    "save_dataloaders": False,
}


class BudgetSpent(Exception):
    """Raised after an epoch's validation when the next epoch would overrun --max-minutes."""


@dataclass
class EpochRecord:
    """One epoch: its training time and loss, and RecBole's validation result."""

    epoch: int
    train_s: float
    train_cpu_s: float
    train_loss: float
    valid_s: float = 0.0
    valid: dict[str, float] = field(default_factory=dict)


class TimedTrainer(Trainer):
    """RecBole's Trainer, unchanged in what it computes; it records each epoch and keeps the budget.

    The budget is checked in fit's callback, after the epoch's validation and its checkpoint, so a
    cut run still holds its best checkpoint for the test evaluation.
    """

    def __init__(self, config: Config, model: SASRec, budget_s: float | None) -> None:
        super().__init__(config, model)
        self.budget_s = budget_s
        self.fit_start = time.perf_counter()
        self.records: list[EpochRecord] = []
        self.best_epoch = -1

    def _train_epoch(self, train_data, epoch_idx, loss_func=None, show_progress=False):  # type: ignore[no-untyped-def]
        wall, cpu = time.perf_counter(), time.process_time()
        loss = super()._train_epoch(train_data, epoch_idx, loss_func, show_progress)
        self.records.append(
            EpochRecord(
                epoch=epoch_idx,
                train_s=time.perf_counter() - wall,
                train_cpu_s=time.process_time() - cpu,
                train_loss=float(loss),
            )
        )
        return loss

    def _valid_epoch(self, valid_data, show_progress=False):  # type: ignore[no-untyped-def]
        wall = time.perf_counter()
        score, result = super()._valid_epoch(valid_data, show_progress)
        self.records[-1].valid_s = time.perf_counter() - wall
        self.records[-1].valid = {k: float(v) for k, v in result.items()}
        return score, result

    def on_epoch_end(self, epoch_idx: int, valid_score: float) -> None:
        """fit's callback_fn: note the best epoch (fit saved it), stop if the budget is spent."""
        if self.cur_step == 0:  # early_stopping just updated the best (value >= best)
            self.best_epoch = epoch_idx
        stopping = self.cur_step > self.stopping_step or epoch_idx + 1 >= self.epochs
        if self.budget_s is None or stopping:
            return
        elapsed = time.perf_counter() - self.fit_start
        last = self.records[-1].train_s + self.records[-1].valid_s
        if elapsed + last > self.budget_s:
            raise BudgetSpent(
                f"{elapsed:.0f} s spent, the next epoch would pass {self.budget_s:.0f} s"
            )


@contextmanager
def recbole_argv() -> Iterator[None]:
    """Config also reads `--key=value` from sys.argv (over config_dict): hide this script's."""
    saved = sys.argv
    sys.argv = saved[:1]
    try:
        yield
    finally:
        sys.argv = saved


def make_config(args: argparse.Namespace, workdir: Path) -> tuple[Config, Path]:
    """The Config of the run and the .inter file it reads.

    Without --data, RecBole's own dataset name `ml-100k` (it then reads the file shipped in the
    package and its properties/dataset/ml-100k.yaml). A given file is linked into the work folder
    under another name, with the same settings (BASE_CONFIG repeats ml-100k.yaml's).
    """
    config_dict = dict(BASE_CONFIG)
    config_dict.update(
        seed=args.seed,
        epochs=args.epochs,
        train_batch_size=args.batch,
        checkpoint_dir=str(workdir / "saved"),
    )
    if args.data is None:
        dataset = PACKAGED_DATASET
        inter = Path(recbole.__file__).parent / "dataset_example" / dataset / f"{dataset}.inter"
    else:
        dataset = "movielens-file"
        inter = Path(args.data).resolve()
        folder = workdir / "data" / dataset
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / f"{dataset}.inter"
        link.unlink(missing_ok=True)
        link.symlink_to(inter)
        config_dict["data_path"] = str(workdir / "data")
    with recbole_argv():
        config = Config(model="SASRec", dataset=dataset, config_dict=config_dict)
    return config, inter


def check_config(config: Config, batch: int) -> None:
    """Fail before training if RecBole's effective config is not the protocol (with `batch`)."""
    expect = {
        "MODEL_TYPE": "ModelType.SEQUENTIAL",
        "MODEL_INPUT_TYPE": "InputType.POINTWISE",
        "device": "cpu",
        "eval_type": "EvaluatorType.RANKING",
    }
    for key, value in expect.items():
        assert str(config[key]) == value, (key, config[key])
    assert config["train_batch_size"] == batch, (config["train_batch_size"], batch)
    for key, value in BASE_CONFIG.items():
        if key in {"train_neg_sample_args", "gpu_id", "train_batch_size"}:
            continue
        assert config[key] == value, (key, config[key], value)
    # CE: no negative sampling in training (Config turns None into distribution "none").
    train_neg = config["train_neg_sample_args"]
    assert train_neg["distribution"] == "none", train_neg
    # Full ranking: no sampled candidates (main also checks the loaders are FullSortEvalDataLoader).
    for phase in ("valid", "test"):
        assert config[f"{phase}_neg_sample_args"]["sample_num"] == "none"
    assert config["benchmark_filename"] is None


def read_raw(inter: Path) -> pd.DataFrame:
    """The .inter file as written, one row per line, file order kept in `pos`."""
    df = pd.read_csv(inter, sep="\t", dtype={"user_id:token": str, "item_id:token": str})
    df.columns = [c.split(":")[0] for c in df.columns]
    df["pos"] = np.arange(len(df))
    return df


def user_sequences(raw: pd.DataFrame, key: np.ndarray) -> dict[str, list[str]]:
    """Each user's items sorted by `key`, equal keys in file order (RecBole's sorts are stable)."""
    order = np.lexsort((raw["pos"].to_numpy(), key, raw["user_id"].to_numpy()))
    ordered = raw.iloc[order]
    return {u: list(g["item_id"]) for u, g in ordered.groupby("user_id", sort=False)}


def recbole_time_key(raw: pd.DataFrame) -> np.ndarray:
    """The key RecBole sorts by: min-max normalized timestamp (normalize_all), stored as float32.

    float32 keeps about 2**-24 of the range (~1 s of MovieLens-100k's 215 days), so timestamps a
    second or two apart can tie and then fall back to file order.
    """
    t = raw["timestamp"].to_numpy(np.float64)
    return ((t - t.min()) / (t.max() - t.min())).astype(np.float32)


def split_samples(ds: Any) -> list[tuple[str, str, list[str]]]:
    """(user, target item, history items) of each sample of a built RecBole split, in its order."""
    feat = ds.inter_feat
    users = ds.field2id_token["user_id"][feat["user_id"].numpy()]
    items = ds.field2id_token["item_id"]
    targets = items[feat["item_id"].numpy()]
    lists = feat["item_id_list"].numpy()
    lengths = feat["item_length"].numpy()
    return [
        (u, t, list(items[row[:n]]))
        for u, t, row, n in zip(users, targets, lists, lengths, strict=True)
    ]


def check_split(raw: pd.DataFrame, train: Any, valid: Any, test: Any) -> dict[str, Any]:
    """Check RecBole's split, sample by sample, against leave-one-out by time (RECBOLE_PROTOCOL.md).

    Per user with items s[0..n-1] (time order): train targets s[1..n-3], each with the up to 50
    items before it; valid target s[n-2]; test target s[n-1] with s[n-51..n-2] (valid included).
    """
    seqs = user_sequences(raw, recbole_time_key(raw))
    train_by_user: dict[str, list[tuple[str, list[str]]]] = {}
    for u, t, hist in split_samples(train):
        train_by_user.setdefault(u, []).append((t, hist))
    heldout = {name: split_samples(ds) for name, ds in (("valid", valid), ("test", test))}
    for name, samples in heldout.items():
        assert len(samples) == len(seqs), (name, len(samples), len(seqs))
        assert len({u for u, _, _ in samples}) == len(seqs), name
    for name, back in (("valid", 2), ("test", 1)):
        for u, t, hist in heldout[name]:
            s = seqs[u]
            j = len(s) - back
            assert t == s[j] and hist == s[max(0, j - MAX_LEN) : j], (name, u)
    for u, s in seqs.items():
        want = [(s[j], s[max(0, j - MAX_LEN) : j]) for j in range(1, len(s) - 2)]
        assert train_by_user.get(u, []) == want, ("train", u)
    # How much the float32 key matters: the same split from the raw integer timestamps.
    by_raw = user_sequences(raw, raw["timestamp"].to_numpy())
    return {
        "users": len(seqs),
        "train_samples": sum(len(v) for v in train_by_user.values()),
        "valid_samples": len(heldout["valid"]),
        "test_samples": len(heldout["test"]),
        "matches_leave_one_out_by_float32_time": True,
        "users_with_other_order_by_raw_timestamp": sum(by_raw[u] != s for u, s in seqs.items()),
        "users_with_other_valid_target_by_raw_timestamp": sum(
            by_raw[u][-2] != s[-2] for u, s in seqs.items()
        ),
        "users_with_other_test_target_by_raw_timestamp": sum(
            by_raw[u][-1] != s[-1] for u, s in seqs.items()
        ),
    }


def metrics_at(result: dict[str, float] | None) -> dict[str, float]:
    """RecBole's result (keys like 'ndcg@10') as plain floats, in a fixed order."""
    if not result:
        return {}
    return {f"{m.lower()}@{k}": float(result[f"{m.lower()}@{k}"]) for m in METRICS for k in TOPK}


def jsonable(value: Any) -> Any:
    """Config values (enums, devices, tuples) as JSON."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=2020, help="RecBole's seed (its default 2020)")
    parser.add_argument(
        "--epochs", type=int, default=300, help="most epochs; early stopping ends sooner"
    )
    parser.add_argument("--max-minutes", type=float, default=None, help="wall budget for training")
    parser.add_argument(
        "--data", default=None, help="an ml-100k style .inter file (default: RecBole's)"
    )
    parser.add_argument(
        "--batch", type=int, default=2048, help="train_batch_size (RecBole's default 2048)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--workdir", default=None, help="logs and checkpoints (default runs/...)")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args()

    wall0, cpu0 = time.perf_counter(), time.process_time()
    json_path = Path(args.json).resolve() if args.json else None
    workdir = Path(args.workdir or f"runs/movielens-recbole/seed{args.seed}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if args.data is not None:
        args.data = str(Path(args.data).resolve())
    os.chdir(workdir)  # RecBole writes log/ and log_tensorboard/ under the current folder
    if args.threads:
        torch.set_num_threads(args.threads)

    config, inter = make_config(args, workdir)
    check_config(config, args.batch)
    init_seed(config["seed"], config["reproducibility"])
    init_logger(config)

    raw = read_raw(inter)
    dataset = create_dataset(config)
    counts = {
        "users": dataset.user_num - 1,  # id 0 is [PAD]
        "items": dataset.item_num - 1,
        "interactions": dataset.inter_num,
    }
    raw_counts = {
        "users": raw["user_id"].nunique(),
        "items": raw["item_id"].nunique(),
        "interactions": len(raw),
    }
    print(f"dataset {inter.name}: {counts} (file: {raw_counts})", flush=True)
    assert counts == raw_counts, "RecBole filtered the data"

    train_data, valid_data, test_data = data_preparation(config, dataset)
    assert isinstance(valid_data, FullSortEvalDataLoader), type(valid_data)
    assert isinstance(test_data, FullSortEvalDataLoader), type(test_data)
    split = check_split(raw, train_data._dataset, valid_data._dataset, test_data._dataset)
    print(f"split: {split}", flush=True)

    # As run_recbole: the model is seeded again after the data is split.
    init_seed(config["seed"] + config["local_rank"], config["reproducibility"])
    model = SASRec(config, train_data._dataset).to(config["device"])
    budget_s = args.max_minutes * 60 if args.max_minutes else None
    trainer = TimedTrainer(config, model, budget_s)
    cut, cut_reason = False, None
    try:
        trainer.fit(
            train_data,
            valid_data,
            saved=True,
            show_progress=False,
            callback_fn=trainer.on_epoch_end,
        )
    except BudgetSpent as stop:
        cut, cut_reason = True, str(stop)
        print(f"cut: {stop}", flush=True)
    test = trainer.evaluate(test_data, load_best_model=True, show_progress=False)
    trainer.tensorboard.close()

    best = next((r for r in trainer.records if r.epoch == trainer.best_epoch), None)
    result = {
        "peer": "recbole-sasrec",
        "seed": args.seed,
        "data": str(inter),
        "dataset_counts": counts,
        "split_check": split,
        "epochs_run": len(trainer.records),
        "max_epochs": args.epochs,
        "epoch_train_s": [round(r.train_s, 3) for r in trainer.records],
        "epoch_train_cpu_s": [round(r.train_cpu_s, 3) for r in trainer.records],
        "epoch_valid_s": [round(r.valid_s, 3) for r in trainer.records],
        "epoch_train_loss": [r.train_loss for r in trainer.records],
        "epoch_valid": [metrics_at(r.valid) for r in trainer.records],
        "best_epoch": trainer.best_epoch,
        "best_valid": metrics_at(best.valid if best else None),
        "test": metrics_at(test),
        "cut": cut,
        "cut_reason": cut_reason,
        "max_minutes": args.max_minutes,
        "wall_s": round(time.perf_counter() - wall0, 3),
        "cpu_s": round(time.process_time() - cpu0, 3),
        "torch_threads": torch.get_num_threads(),
        "recbole": recbole.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "config": jsonable(dict(config.final_config_dict)),
    }
    print(json.dumps({k: result[k] for k in ("epochs_run", "best_epoch", "best_valid", "test")}))
    print(f"train s/epoch {result['epoch_train_s']}, cpu s/epoch {result['epoch_train_cpu_s']}")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
