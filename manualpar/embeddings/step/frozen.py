"""Frozen tables: a table whose weight has requires_grad=False is left out of the update.

`emb.requires_grad_(False)` freezes a whole sharded collection, `emb.tables[name].weight
.requires_grad_(False)` one table (set on the unsharded collection, the flag carries over to
`shard_embeddings`). The flags are read at each forward: that step's backward skips frozen
tables' updates and leaves their columns out of the gradient exchange, and a step with every
table frozen has no backward at all. The exchange layout depends on them, so every rank must
freeze the same tables: each rank's flags travel in the forward's size exchange (a few int64
words) and a disagreement stops every rank with the same error instead of a mismatched
exchange.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from manualpar.embeddings.exchange_layout import WORD_BITS, num_words
from manualpar.embeddings.modules.bag_collection import table_weight
from manualpar.errors import BuilderError

__all__ = ["agreed_frozen", "frozen_from_words", "frozen_tables", "frozen_to_words", "num_words"]


def frozen_tables(tables: nn.ModuleDict, names: Sequence[str]) -> frozenset[int]:
    """Indices (into `names`) of the tables whose block on this rank does not require grad
    (read every step: each weight straight from its module's parameters, table_weight)."""
    return frozenset(
        t for t, name in enumerate(names) if not table_weight(tables, name).requires_grad
    )


def frozen_to_words(frozen: frozenset[int], num_tables: int) -> list[int]:
    """The frozen table indices as bit flags in int64 words (the size exchange carries them)."""
    words = [0] * num_words(num_tables)
    for t in frozen:
        words[t // WORD_BITS] |= 1 << (t % WORD_BITS)
    return words


def frozen_from_words(words: Sequence[int]) -> frozenset[int]:
    """The table indices flagged in `words` (frozen_to_words undone)."""
    return frozenset(
        w * WORD_BITS + bit
        for w, word in enumerate(words)
        for bit in range(WORD_BITS)
        if word >> bit & 1
    )


def agreed_frozen(words_per_rank: Sequence[Sequence[int]], names: Sequence[str]) -> frozenset[int]:
    """The frozen tables every rank reported; BuilderError (the same on every rank) if the
    ranks disagree."""
    sets = [frozen_from_words(words) for words in words_per_rank]
    if all(s == sets[0] for s in sets):
        return sets[0]
    listed = "; ".join(
        f"rank {rank}: {sorted(names[t] for t in s) if s else 'none'}"
        for rank, s in enumerate(sets)
    )
    raise BuilderError(
        f"shard_embeddings: the ranks freeze different tables (weight.requires_grad=False) "
        f"({listed}); freeze and unfreeze tables identically on every rank before the same "
        "forward"
    )
