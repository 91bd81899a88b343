"""splitmix64: the one hash behind table init, bfloat16 stochastic rounding, raw-id hashing and
managed collisions.

Its finalizer is cheap, bijective on 64 bits and passes BigCrush, so (key, counter) streams
give independent-looking bits for any element, row or id without any state: every rank computes
the same bits for the same element whatever the plan. The Python-int forms make keys; the
tensor forms work on int64 tensors holding uint64 bit patterns (int64 arithmetic wraps as
uint64 does), on any device. The C++ kernels use the same constants.
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["mix", "mix64", "mix64_int", "shift_right", "signed", "table_key", "torch_mix"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def mix(z: int) -> int:
    """splitmix64's finalizer on a 64-bit unsigned int."""
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def table_key(seed: int, table: str) -> int:
    """The 64-bit stream key of one table (unsigned)."""
    return mix((seed * _GOLDEN + zlib.crc32(table.encode())) & _MASK64)


def signed(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int64 bit patterns (torch's >> on int64 is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors holding uint64 bit patterns (any device)."""
    z = (z ^ shift_right(z, 30)) * signed(_MIX1)
    z = (z ^ shift_right(z, 27)) * signed(_MIX2)
    return z ^ shift_right(z, 31)


def mix64_int(z: int) -> int:
    """splitmix64's finalizer on a Python int (taken mod 2**64), unsigned."""
    return mix(z & _MASK64)


def torch_mix(key: int, counters: torch.Tensor) -> torch.Tensor:
    """splitmix64 of (key, counter) for int64 `counters`: int64 bit patterns."""
    return mix64(counters * signed(_GOLDEN) + signed(key))  # int64 arithmetic wraps like uint64
