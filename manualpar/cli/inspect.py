"""`python -m manualpar inspect CKPT`: keys, shapes, sharding and step of a checkpoint."""

from __future__ import annotations

import argparse
import json
from typing import Any

from manualpar.checkpoint.describe import describe_checkpoint

__all__ = ["add_arguments", "format_description", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    info = describe_checkpoint(args.checkpoint)
    print(json.dumps(info, indent=2) if args.json else format_description(info))
    return 0


def format_description(info: dict[str, Any]) -> str:
    lines = [
        f"checkpoint {info['path']}",
        f"  kind {info['kind']}, step {info['step']}, saved by {info['world_size']} rank(s), "
        f"{info['bytes'] / 2**20:.2f} MiB on disk",
        "  entries: " + ", ".join(f"{k} ({v})" for k, v in info["entries"].items()),
        f"  {len(info['tensors'])} tensors:",
    ]
    width = max((len(k) for k in info["tensors"]), default=0)
    for key, meta in info["tensors"].items():
        shape = "x".join(map(str, meta["shape"])) or "scalar"
        split = f"  ({meta['chunks']} chunks)" if meta["chunks"] > 1 else ""
        lines.append(f"    {key:<{width}}  {shape:>14}  {meta['dtype']}{split}")
    return "\n".join(lines)
