"""Describe a checkpoint without loading it into a model: entries, keys, shapes, step, sharding,
and the records that give its tensors their meaning (checkpoint/records.py).

Reads the manifest and torch.distributed.checkpoint's metadata (tensor sizes and how they were
split into chunks), or the header of a full export; it never builds a model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from manualpar.checkpoint.files import FULL_KEY, read_full, read_manifest
from manualpar.checkpoint.records import MANIFEST_KEY as RECORDS
from manualpar.errors import CheckpointError

__all__ = ["describe_checkpoint"]


def describe_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A plain dict: kind, step, world size, entries, records (empty for a checkpoint saved
    before records existed), and per tensor its shape, dtype, chunks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    if path.is_file():
        return _describe_full(path)
    manifest = read_manifest(path)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:
        raise CheckpointError(f"{path}: unreadable tensor metadata: {error}") from None
    tensors = {}
    for key, meta in sorted(metadata.state_dict_metadata.items()):
        if isinstance(meta, TensorStorageMetadata):
            tensors[key] = {
                "shape": list(meta.size),
                "dtype": str(meta.properties.dtype),
                "chunks": len(meta.chunks),
            }
    return {
        "path": str(path),
        "kind": manifest["kind"],
        "step": manifest.get("step"),
        "world_size": manifest["world_size"],
        "entries": manifest["entries"],
        "records": manifest.get(RECORDS) or {},
        "tensors": tensors,
        "bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
    }


def _describe_full(path: Path) -> dict[str, Any]:
    blob = read_full(path)
    header = blob[FULL_KEY]
    tensors: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors[prefix] = {"shape": list(value.shape), "dtype": str(value.dtype), "chunks": 1}
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}" if prefix else str(key), item)

    walk("", {k: v for k, v in blob.items() if k != FULL_KEY})
    return {
        "path": str(path),
        "kind": header.get("kind", "full"),
        "step": header.get("step"),
        "world_size": header.get("world_size"),
        "entries": header.get("entries", {}),
        "records": header.get(RECORDS) or {},
        "tensors": tensors,
        "bytes": path.stat().st_size,
    }
