"""Table dtypes by their short names (command lines, JSON table lists): fp32, fp16, bf16."""

from __future__ import annotations

import torch

from manualpar.errors import EmbeddingInputError

__all__ = ["DTYPE_NAMES", "dtype_name", "table_dtype"]

# Short names of the table dtypes (plan files, `--table-dtype`), and the dtype each means.
DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_LONG_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def table_dtype(name: str) -> torch.dtype:
    """'fp16' or 'float16' (or 'torch.float16') -> torch.float16; anything else raises."""
    key = name.removeprefix("torch.")
    dtype = DTYPE_NAMES.get(key) or _LONG_NAMES.get(key)
    if dtype is None:
        raise EmbeddingInputError(
            f"table dtype {name!r} is not supported; use one of {', '.join(DTYPE_NAMES)} "
            f"(or {', '.join(_LONG_NAMES)})"
        )
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bf16'."""
    return next(name for name, d in DTYPE_NAMES.items() if d == dtype)
