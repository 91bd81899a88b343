"""Tensors loaded into another dtype than they were saved in: converted, and said so.

A table saved in bfloat16 loads into float32 tables (or back) by value: DCP and the full
export's copy both convert on the way in (float32 to a half dtype rounds to nearest). The
conversion is deliberate but lossy one way, so each converted tensor gets one log line naming
both dtypes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["log_conversions", "saved_dtypes"]

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
