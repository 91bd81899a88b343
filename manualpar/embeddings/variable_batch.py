"""A batch per feature: each feature's own number of bags, and the indices that expand them back.

A deduplicated feature (one user's bag for the 8 item rows of its request) holds fewer bags than
the batch has samples: `bags_per_key[f]` bags, and sample b of feature f reads bag
`inverse_indices[f, b]`. This is TorchRec's variable-stride form (stride_per_key_per_rank,
inverse_indices). The checks run when a SparseFeatures is built (features.py); `expand_bags`
gives a feature's bags at the full batch, the reference a variable batch must match.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from manualpar.environment import detect_environment
from manualpar.errors import ClusterEnvironmentError, EmbeddingInputError

__all__ = [
    "bag_starts",
    "check_variable_batch",
    "expand_bags",
    "ids_per_key",
    "inverse_rows",
    "on_rank",
    "unread_emptied",
]


def on_rank() -> str:
    """' on rank N' in a job of several processes (errors are read in one rank's log), else ''."""
    try:
        environment = detect_environment()
    except ClusterEnvironmentError:
        return ""
    return f" on rank {environment.rank}" if environment.is_distributed else ""


def bag_starts(bags: Sequence[int]) -> list[int]:
    """Where each key's bags start in `lengths`, and where the last ends."""
    starts = [0]
    for count in bags:
        starts.append(starts[-1] + count)
    return starts


def ids_per_key(lengths: torch.Tensor, bags: Sequence[int]) -> list[int]:
    """Each key's number of ids: the sum of its bags' lengths (one host read)."""
    ends = torch.tensor(bag_starts(bags), dtype=torch.int64, device=lengths.device)
    cumulative = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=cumulative[1:])
    at = cumulative[ends]
    sizes: list[int] = (at[1:] - at[:-1]).tolist()
    return sizes


def check_variable_batch(
    keys: Sequence[str],
    lengths: torch.Tensor,
    bags: Sequence[int],
    inverse: torch.Tensor,
) -> None:
    """Raise EmbeddingInputError naming the feature, what was expected and the rank: one bag
    count per key, lengths for exactly those bags, and every inverse index within its feature's
    bags."""
    where = on_rank()
    if len(bags) != len(keys) or any(not isinstance(n, int) or n < 0 for n in bags):
        raise EmbeddingInputError(
            f"bags_per_key must give one bag count >= 0 per feature {list(keys)}, got "
            f"{list(bags)}{where}"
        )
    if sum(bags) != lengths.numel():
        raise EmbeddingInputError(
            f"lengths has {lengths.numel()} entries but bags_per_key "
            f"{dict(zip(keys, bags, strict=True))} adds up to {sum(bags)} bags{where}: lengths "
            "holds one length per bag, feature by feature"
        )
    if not isinstance(inverse, torch.Tensor) or inverse.dim() != 2:
        got = tuple(inverse.shape) if isinstance(inverse, torch.Tensor) else type(inverse).__name__
        raise EmbeddingInputError(
            f"inverse_indices must be a 2-D tensor (features, batch), one row per feature "
            f"{list(keys)}, got {got}{where}"
        )
    if inverse.dtype not in (torch.int64, torch.int32) or inverse.shape[0] != len(keys):
        raise EmbeddingInputError(
            f"inverse_indices must hold integer bag indices, one row per feature {list(keys)}: "
            f"got {inverse.dtype} of shape {tuple(inverse.shape)}{where}"
        )
    if not inverse.numel():
        return
    low, high = inverse.amin(1).tolist(), inverse.amax(1).tolist()
    for f, key in enumerate(keys):
        if low[f] < 0 or high[f] >= bags[f]:
            bad = low[f] if low[f] < 0 else high[f]
            sample = int((inverse[f] == bad).nonzero()[0])
            raise EmbeddingInputError(
                f"feature {key!r}: inverse index {bad} for sample {sample} is outside [0, "
                f"{bags[f]}) (the feature has {bags[f]} bags){where}; each sample names one of "
                "its feature's bags"
            )


def expand_bags(
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    inverse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One feature's bags copied to every sample that reads them: (ids, lengths, weights) of
    the full batch, sample b holding bag inverse[b]'s ids in order."""
    starts = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=starts[1:])
    out_lengths = lengths.index_select(0, inverse)
    out_starts = torch.zeros(inverse.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(out_lengths, 0, out=out_starts[1:])
    shift = torch.repeat_interleave(
        starts[:-1].index_select(0, inverse) - out_starts[:-1], out_lengths
    )
    positions = torch.arange(shift.numel(), device=values.device) + shift
    picked = None if weights is None else weights.index_select(0, positions)
    return values.index_select(0, positions), out_lengths, picked


def inverse_rows(
    keys: tuple[str, ...], bags: Mapping[str, int], given: Mapping[str, Sequence[int]]
) -> torch.Tensor:
    """(keys, batch) inverse indices from the rows `given` for some keys: the others hold one
    bag per sample (their row counts 0, 1, ...)."""
    unknown = [key for key in given if key not in keys]
    widths = {len(row) for row in given.values()}
    if unknown or len(widths) > 1:
        raise EmbeddingInputError(
            f"inverse_indices must name features of the batch {list(keys)} with one index per "
            f"sample each, got rows for {list(given)} of lengths "
            f"{ {key: len(row) for key, row in given.items()} }"
        )
    batch = widths.pop() if widths else 0
    plain = {key: bags[key] for key in keys if key not in given and bags[key] != batch}
    if plain:
        raise EmbeddingInputError(
            f"features {plain} (bag counts) have no inverse_indices, so they need one bag per "
            f"sample: {batch} samples{on_rank()}; give them inverse_indices too"
        )
    rows = [list(given[key]) if key in given else list(range(batch)) for key in keys]
    return torch.tensor(rows, dtype=torch.int64).view(len(keys), batch)


def unread_emptied(
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    bags: Sequence[int],
    inverse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The batch's ids, lengths and weights with the bags no sample reads emptied, or None when
    every bag is read (one host read)."""
    starts = torch.tensor(bag_starts(bags)[:-1], dtype=torch.int64, device=inverse.device)
    read = torch.zeros(lengths.numel(), dtype=torch.bool, device=lengths.device)
    read[(inverse + starts.unsqueeze(1)).flatten()] = True
    if bool(read.all()):
        return None
    kept = torch.repeat_interleave(read, lengths)
    return values[kept], torch.where(read, lengths, 0), None if weights is None else weights[kept]
