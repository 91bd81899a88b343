"""`python -m manualpar inspect CKPT`: keys, shapes, sharding and step of a checkpoint, and the
records a load checks (each table's raw-id setting, the Trainer's global batch).

CKPT may also be a folder of checkpoints or a Trainer run (its `checkpoints/`): the latest
committed checkpoint in it is described.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from manualpar import MANIFEST, CheckpointError, describe_checkpoint, latest_checkpoint

__all__ = ["add_arguments", "format_description", "resolve_checkpoint", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint, a folder of them, or a Trainer run")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    info = describe_checkpoint(resolve_checkpoint(Path(args.checkpoint)))
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0


def resolve_checkpoint(path: Path) -> Path:
    """`path` if it is a checkpoint; else the latest one in it or in its `checkpoints/`."""
    if path.is_file() or (path / MANIFEST).is_file() or not path.is_dir():
        return path
    for folder in (path, path / "checkpoints"):
        found = latest_checkpoint(folder) if folder.is_dir() else None
        if found is not None:
            return found
    raise CheckpointError(
        f"{path} is not a checkpoint and holds no committed checkpoint (nor does "
        f"{path / 'checkpoints'}); pass a checkpoint directory or a full export"
    )


def format_description(info: dict[str, Any]) -> str:
    lines = [
        f"checkpoint {info['path']}",
        f"  kind {info['kind']}, step {info['step']}, saved by {info['world_size']} rank(s), "
        f"{info['bytes'] / 2**20:.2f} MiB on disk",
        "  entries: " + ", ".join(f"{k} ({v})" for k, v in info["entries"].items()),
        *(f"  record {name}: {json.dumps(record)}" for name, record in info["records"].items()),
        f"  {len(info['tensors'])} tensors:",
    ]
    width = max((len(k) for k in info["tensors"]), default=0)
    for key, meta in info["tensors"].items():
        shape = "x".join(map(str, meta["shape"])) or "scalar"
        split = f"  ({meta['chunks']} chunks)" if meta["chunks"] > 1 else ""
        lines.append(f"    {key:<{width}}  {shape:>14}  {meta['dtype']}{split}")
    return "\n".join(lines)
