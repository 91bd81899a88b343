"""The size exchange that opens every step (exchange.py, 1; from the second step on it rides
behind short ids, ids_exchange.py): each rank tells every rank its batch size, the length of
the payload it sends it, whether ids carry weights (and whether its features have bags of their
own, VARIABLE: a bit of the same value) and which tables it froze; a rank whose batch failed
validation sends REFUSED instead, so every rank stops at the same step naming it."""

from __future__ import annotations

import torch

from manualpar.embeddings.exchange_layout import header_width
from manualpar.errors import EmbeddingInputError

__all__ = [
    "FOLDS",
    "REFUSED",
    "VARIABLE",
    "WEIGHTED",
    "check_refusals",
    "header_width",
    "size_header",
]

REFUSED = -1  # the sizes a rank sends when its own batch failed validation
WEIGHTED, VARIABLE = 1, 2  # bits of the third value: ids carry weights; a batch per feature
FOLDS = 4  # and (set and taken out by ids_exchange.py): the sender asks for one exchange


def size_header(
    batch: int,
    payloads: list[torch.Tensor],
    weighted: bool,
    frozen_words: list[int],
    variable: bool = False,
) -> torch.Tensor:
    """What the size exchange sends each rank: [batch size, payload length, WEIGHTED |
    VARIABLE bits, the frozen tables' flag words]."""
    bits = (WEIGHTED if weighted else 0) | (VARIABLE if variable else 0)
    return torch.tensor(
        [[batch, p.numel(), bits, *frozen_words] for p in payloads],
        dtype=torch.int64,
        device=payloads[0].device,
    ).flatten()


def check_refusals(sizes_in: list[list[int]]) -> None:
    refused = [rank for rank, size in enumerate(sizes_in) if size[0] == REFUSED]
    if refused:
        raise EmbeddingInputError(
            f"rank {', '.join(map(str, refused))} refused its batch (the error is in that "
            f"rank's log); every rank stops at this step. Fix the input on that rank"
        )
