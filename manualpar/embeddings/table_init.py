"""Initial table values that do not depend on how the table is sharded.

Rows are generated in fixed blocks of ROW_BLOCK rows, each from a generator seeded by (seed,
table name, block index): any rank can produce any rectangle of any table by itself, and a
sharded table holds exactly the values of the unsharded one, for every plan and world size.
"""

from __future__ import annotations

import zlib

import torch

from manualpar.embeddings.config import EmbeddingBagConfig

__all__ = ["ROW_BLOCK", "init_rows"]

ROW_BLOCK = 4096


def _block_seed(seed: int, table: str, block: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(table.encode()) * 65_537 + block) % (2**63 - 1)


@torch.no_grad()
def init_rows(config: EmbeddingBagConfig, seed: int, rows: tuple[int, int],
              columns: tuple[int, int], out: torch.Tensor | None = None) -> torch.Tensor:
    """Values of rows [r0, r1) and columns [c0, c1) of the table, on CPU unless `out` is given."""
    (r0, r1), (c0, c1) = rows, columns
    if out is None:
        out = torch.empty(r1 - r0, c1 - c0)
    generator = torch.Generator()
    for block in range(r0 // ROW_BLOCK, (r1 - 1) // ROW_BLOCK + 1 if r1 > r0 else 0):
        start = block * ROW_BLOCK
        size = min(ROW_BLOCK, config.num_embeddings - start)
        generator.manual_seed(_block_seed(seed, config.name, block))
        values = torch.rand(size, config.embedding_dim, generator=generator)
        lo, hi = max(start, r0), min(start + size, r1)
        piece = values[lo - start:hi - start, c0:c1].mul_(2 * config.bound).sub_(config.bound)
        out[lo - r0:hi - r0].copy_(piece)
    return out
