"""The run's shape (model and data), saved as OUT/config.json so reshard.py rebuilds the same
model and evaluation batch at any world size without repeating the training flags."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from data import MarkovText
from model import TinyLM

SHAPE = ("vocab", "seq_len", "width", "depth", "heads", "seed")  # fixed for the life of a run


@dataclass(frozen=True)
class RunConfig:
    vocab: int = 16
    seq_len: int = 64
    width: int = 64
    depth: int = 4
    heads: int = 4
    lr: float = 3e-3
    batch_size: int = 48  # global: all ranks together
    eval_batch_size: int = 96  # global, fixed: the evaluation batch
    seed: int = 0
    mesh: str = "flat"  # how the blocks are laid out over ranks; a resumed run may change it

    def model(self) -> TinyLM:
        """The model (call under mp.empty_init() to declare it on meta)."""
        return TinyLM(
            self.vocab,
            width=self.width,
            depth=self.depth,
            heads=self.heads,
            max_len=self.seq_len,
            lr=self.lr,
            seed=self.seed,
            mesh=self.mesh,
        )

    def data(self) -> MarkovText:
        return MarkovText(
            self.vocab,
            self.seq_len,
            batch_size=self.batch_size,
            eval_batch_size=self.eval_batch_size,
            seed=self.seed,
        )

    def shape_changes(self, saved: RunConfig) -> list[str]:
        """The model or data fields that differ from `saved` (a resumed run must keep them)."""
        return [
            f"--{name.replace('_', '-')} {getattr(saved, name)} -> {getattr(self, name)}"
            for name in SHAPE
            if getattr(saved, name) != getattr(self, name)
        ]

    def save(self, out: str | Path) -> Path:
        path = Path(out) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def exists(cls, out: str | Path) -> bool:
        return (Path(out) / "config.json").is_file()

    @classmethod
    def load(cls, out: str | Path) -> RunConfig:
        path = Path(out) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: pass the --out of a train.py run")
        saved = json.loads(path.read_text())
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})
