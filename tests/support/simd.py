"""The C++ kernels at a chosen vector level (0 portable, 1 AVX2, 2 AVX-512), for tests that
compare every level's bits with the portable loops'."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from manualpar.embeddings.kernels.native import native_kernels


@contextmanager
def simd_level(level: int) -> Iterator[int]:
    """Runs the block at `level` or the widest below it this CPU has (yielded)."""
    kernels = native_kernels()
    try:
        yield kernels.set_simd_level(level)
    finally:
        kernels.set_simd_level(2)  # back to the widest this CPU has
