"""Rounding float32 update results back to half-precision rows (float16, bfloat16).

Updates compute in float32 and round once per element: float16 to nearest (its 10-bit mantissa
keeps small updates well enough), bfloat16 stochastically by default, as FBGEMM does. bfloat16
keeps 8 bits of mantissa, so an update below half a unit in the last place would be lost every
time by rounding to nearest; rounding up with probability equal to the dropped fraction keeps
its expected value. The 16 random bits added below the kept ones come from a splitmix64 hash
(splitmix.py's) of (collection seed, table, update step) and the element's global index
row * dim + column (one hash per 4 consecutive indices, a 16-bit word each: hashing was most of
a bfloat16 update's extra cost): the result is the same for every plan and world size, and the
C++ kernel and the torch ops below give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.kernels.splitmix import mix, signed, table_key, torch_mix

__all__ = [
    "HALF_DTYPES",
    "RowRounding",
    "accumulation_dtype",
    "add_rounded",
    "round_rows",
    "rounding_key",
]

HALF_DTYPES = (torch.float16, torch.bfloat16)
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
# Keeps the rounding streams apart from the initial values' (same seed and table name).
_ROUNDING_SALT = 0x5EED_0F_B16_B175
_KEPT_BF16 = -(1 << 16)  # int32 mask 0xFFFF0000: bfloat16 is float32's top 16 bits


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What lookups of rows stored in `dtype` sum in, and return: float32 for half rows."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def rounding_key(seed: int, table: str, step: int) -> int:
    """The signed 64-bit key of one table's rounding stream at update `step`."""
    return signed(mix((table_key(seed, table) ^ _ROUNDING_SALT) + step * _GOLDEN & _MASK64))


@dataclass(frozen=True)
class RowRounding:
    """How one update of a block rounds to its rows' `dtype`: stochastically (bfloat16's
    default) with the stream `key`, the block starting at (`row_start`, `col_start`) of a table
    `dim` wide, so each element draws the bits of its global position."""

    dtype: torch.dtype
    key: int
    row_start: int
    col_start: int
    dim: int
    stochastic: bool = True
    # a disk tier's cache: the block row each cache slot holds (RowCache.row_of), so an element
    # draws the bits of its table position, not of its slot; None: rows are the block's own
    slot_rows: torch.Tensor | None = None

    @classmethod
    def for_block(
        cls,
        dtype: torch.dtype,
        seed: int,
        table: str,
        step: int,
        offsets: tuple[int, int],
        dim: int,
        slot_rows: torch.Tensor | None = None,
    ) -> RowRounding:
        return cls(
            dtype,
            rounding_key(seed, table, step),
            offsets[0],
            offsets[1],
            dim,
            stochastic=dtype == torch.bfloat16,
            slot_rows=slot_rows,
        )

    @property
    def draws(self) -> bool:
        """Whether random bits are drawn (only bfloat16 rounds stochastically)."""
        return self.stochastic and self.dtype == torch.bfloat16


def random_bits(rounding: RowRounding, rows: torch.Tensor, cols: int) -> torch.Tensor:
    """(rows, cols) int32 in [0, 2^16): of each element's global index i (row * dim + column),
    16-bit word i % 4 of the hash of i / 4 (one 64-bit hash serves 4 elements)."""
    columns = torch.arange(rounding.col_start, rounding.col_start + cols, device=rows.device)
    block_rows = rows if rounding.slot_rows is None else rounding.slot_rows[rows]
    index = (block_rows + rounding.row_start).unsqueeze(1) * rounding.dim + columns
    hashes = torch_mix(rounding.key, index >> 2)
    return ((hashes >> (index & 3) * 16) & 0xFFFF).to(torch.int32)


def round_rows(values: torch.Tensor, rows: torch.Tensor, rounding: RowRounding) -> torch.Tensor:
    """float32 `values` of local `rows` of a block, rounded to the block's dtype."""
    if not rounding.draws:
        return values.to(rounding.dtype)
    bits = values.contiguous().view(torch.int32) + random_bits(rounding, rows, values.shape[1])
    return bits.bitwise_and_(_KEPT_BF16).view(torch.float32).to(torch.bfloat16)


def add_rounded(
    tensor: torch.Tensor,
    rows: torch.Tensor,
    delta: torch.Tensor,
    alpha: float,
    rounding: RowRounding,
) -> None:
    """tensor[rows] = round(tensor[rows] + alpha * delta) for distinct `rows` of half rows,
    float32 `delta`. The product is rounded before the sum in both paths (no fused
    multiply-add), so they agree to the bit."""
    delta = delta.to(torch.float32)
    if native_kernels_take(tensor, delta) and tensor.is_contiguous() and rows.dtype == torch.int64:
        loaded_kernels().add_to_rows_rounded(
            tensor,
            rows.contiguous(),
            delta.contiguous(),
            alpha,
            rounding.draws,
            rounding.key,
            rounding.row_start,
            rounding.col_start,
            rounding.dim,
            rounding.slot_rows,
        )
        return
    values = tensor.index_select(0, rows).float().add_(delta * alpha)
    tensor.index_copy_(0, rows, round_rows(values, rows, rounding))
