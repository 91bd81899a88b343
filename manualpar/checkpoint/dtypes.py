"""Tensors loaded into another dtype than they were saved in: converted, and said so.

A table saved in bfloat16 loads into float32 tables (or back) by value: DCP and the full
export's copy both convert on the way in (float32 to a half dtype rounds to nearest). The
conversion is deliberate but lossy one way, so each converted tensor gets one log line naming
both dtypes.

A value beyond the target dtype's finite range (float32 1e5 into float16, whose largest is
65504) would become inf: such tensors are read in their saved dtype first (a temporary copy of
this rank's part) and checked. Values out of range are refused, naming the tensor and how many,
unless the caller asked for `saturate=True`, which clamps them to the largest finite value.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from manualpar.checkpoint.local_shards import Block, LocalShards
from manualpar.dtensors import is_dtensor
from manualpar.errors import CheckpointError

__all__ = [
    "check_range",
    "copy_back",
    "log_conversions",
    "narrowing",
    "read_copies",
    "saved_dtypes",
]

log = logging.getLogger("manualpar.checkpoint")


def saved_dtypes(metadata: Any) -> dict[str, torch.dtype]:
    """Each tensor's dtype as DCP's metadata records it."""
    return {
        key: meta.properties.dtype
        for key, meta in metadata.state_dict_metadata.items()
        if hasattr(meta, "properties") and hasattr(meta.properties, "dtype")
    }


def log_conversions(
    path: Path, current: Mapping[str, Any], saved: Mapping[str, torch.dtype], rank: int
) -> list[str]:
    """Log (and return) one line per tensor of `current` whose `saved` dtype differs."""
    lines = []
    for key, value in current.items():
        dtype = getattr(value, "dtype", None)
        if key in saved and isinstance(dtype, torch.dtype) and saved[key] != dtype:
            lines.append(
                f"rank {rank}: {key} was saved as {saved[key]} in {path}; loading it into "
                f"{dtype} (converted)"
            )
    for line in lines:
        log.info(line)
    return lines


def narrowing(
    current: Mapping[str, Any], saved: Mapping[str, torch.dtype]
) -> dict[str, torch.dtype]:
    """The keys of `current` whose saved floating dtype reaches beyond the current one's finite
    range (float32 into float16 or bfloat16, float64 into float32), with their saved dtype."""
    found = {}
    for key, value in current.items():
        dtype, source = getattr(value, "dtype", None), saved.get(key)
        if (
            isinstance(dtype, torch.dtype)
            and source is not None
            and dtype.is_floating_point
            and source.is_floating_point
            and torch.finfo(dtype).max < torch.finfo(source).max
        ):
            found[key] = source
    return found


def read_copies(targets: Mapping[str, Any], dtypes: Mapping[str, torch.dtype]) -> dict[str, Any]:
    """An empty copy of each target (plain tensor, DTensor or LocalShards) in its saved dtype,
    for DCP to read into, so the values can be checked before they are converted."""
    copies: dict[str, Any] = {}
    for key, dtype in dtypes.items():
        target = targets[key]
        if isinstance(target, LocalShards):
            blocks = [
                Block(b.offsets, torch.empty_like(b.tensor, dtype=dtype), b.primary)
                for b in target.blocks
            ]
            copies[key] = LocalShards(target.shape, blocks, dtype)
        else:
            copies[key] = torch.empty_like(target, dtype=dtype)
    return copies


def check_range(
    path: Path,
    values: Mapping[str, Any],
    targets: Mapping[str, torch.dtype],
    rank: int,
    *,
    saturate: bool,
) -> None:
    """Raise CheckpointError naming every tensor of `values` holding finite values that would
    become inf in its target dtype; with `saturate`, clamp them in place instead (logged)."""
    problems = []
    for key, value in values.items():
        dtype = targets[key]
        largest = torch.finfo(dtype).max
        parts = _parts(value)
        count = sum(int((torch.isinf(p.to(dtype)) & torch.isfinite(p)).sum()) for p in parts)
        if count == 0:
            continue
        total = sum(p.numel() for p in parts)
        if saturate:
            for part in parts:
                part.clamp_(-largest, largest)
            log.warning(
                "rank %d: %s: %d of %d values saved as %s in %s are beyond %s's finite range; "
                "clamped to +-%g (saturate=True)",
                *(rank, key, count, total, _name(value.dtype), path, _name(dtype), largest),
            )
            continue
        peak = max(float(p.abs().nan_to_num(0.0, 0.0, 0.0).max()) for p in parts if p.numel())
        problems.append(
            f"{key} (saved as {_name(value.dtype)}): {count} of {total} values are beyond "
            f"{_name(dtype)}'s finite range (+-{largest:g}; the largest is {peak:g})"
        )
    if problems:
        raise CheckpointError(
            f"load_checkpoint({path}) on rank {rank}: "
            + "; ".join(problems)
            + ". They would load as inf. Load them into a wider dtype (float32, or bfloat16, "
            "whose range is float32's), rescale them, or pass saturate=True to clamp them to "
            "the largest finite value; nothing was loaded"
        )


def copy_back(copies: Mapping[str, Any], targets: Mapping[str, Any]) -> None:
    """Convert the checked copies into the targets in place, as DCP's own read would have."""
    with torch.no_grad():
        for key, copy in copies.items():
            target = targets[key]
            if isinstance(target, LocalShards):  # a disk table's blocks write their file
                for part, block in zip(_parts(copy), target.blocks, strict=True):
                    block.fill(part)
                continue
            for part, tensor in zip(_parts(copy), _parts(target), strict=True):
                tensor.copy_(part)


def _parts(value: Any) -> list[torch.Tensor]:
    """The plain tensors holding this rank's values of a leaf."""
    if isinstance(value, LocalShards):
        return [block.tensor for block in value.blocks]
    if is_dtensor(value):
        return [value.to_local()]
    return [value]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
