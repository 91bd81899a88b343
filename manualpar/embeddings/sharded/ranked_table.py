"""One table as the ranking (ranking.py) sees it: this rank's rows in pieces, and the ranks
holding the others (none for an unsharded collection or a data-parallel table), with the
collectives over those ranks (none without a strategy).

A block's rows are those its table holds now: a weight replaced by one of the same shape and
dtype is ranked (as the next step trains it); one the next step would refuse (a disk tier's
row cache replaced, another shape, dtype or device) is `refused` with that step's error, which
the ranking's first collective carries to every rank (ranking_checks.agree)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.modules.bag_collection import EmbeddingBagCollection, table_of
from manualpar.embeddings.modules.sequence_collection import EmbeddingCollection
from manualpar.embeddings.sharded.sharded_tables import ShardedTables
from manualpar.embeddings.storage.replaced_cache import refuse_replaced_cache
from manualpar.errors import BuilderError, EmbeddingInputError, PlanError
from manualpar.strategy.uneven import all_gather_uneven

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["Chunks", "Collection", "RankedTable", "gather", "mine", "ranked_table", "sum_over"]

Collection = EmbeddingBagCollection | EmbeddingCollection | ShardedTables
Chunks = Callable[[int], Iterator[tuple[int, torch.Tensor]]]


@dataclass(frozen=True)
class RankedTable:
    """One table as the ranking sees it: this rank's rows, and who else holds the others."""

    config: EmbeddingBagConfig
    device: torch.device
    chunks: Chunks  # (first item id, rows) pieces of this rank's rows, of at most n rows
    strategy: ManualParallelStrategy | None = None  # None: this process holds every row
    group: Any = None  # the ranks holding one copy of the table (a 2-D mesh's shard dim)
    refused: BuilderError | None = None  # this rank's block cannot be read (a replaced weight)


def ranked_table(emb: Collection, name: str, caller: str) -> RankedTable:
    configs = {config.name: config for config in getattr(emb, "configs", ())}
    if not isinstance(emb, Collection) or name not in configs:
        what = type(emb).__name__
        raise EmbeddingInputError(
            f"{caller}: no table {name!r} in the {what}"
            + (f" (its tables: {sorted(configs)})" if configs else "")
            + "; pass an EmbeddingBagCollection, EmbeddingCollection or one from "
            "shard_embeddings, and one of its table names"
        )
    config = configs[name]
    if not isinstance(emb, ShardedTables):
        weight = table_of(emb.tables, name).weight.detach()
        if weight.is_meta:
            raise EmbeddingInputError(
                f"{caller}: table {name!r} is on the meta device (no values yet); materialize "
                "the collection or shard it with shard_embeddings first"
            )
        return RankedTable(config, weight.device, pieces_of([(0, weight)], None))
    placement = emb.plan.tables[name]
    if emb.routing.splits_cols(list(configs).index(name)):
        raise PlanError(
            f"{caller}: table {name!r} is placed {placement}: its columns are split over ranks, "
            "so no rank can score a whole row. Rank against a row_wise, table_wise or "
            "table_row_wise placement of it (load a checkpoint into such a plan), or gather "
            "it (full_tensors()) and use metrics.target_ranks_from_scores"
        )
    block = emb.blocks.by_name[name]
    shard, store = block.shard, block.store
    pieces, refused = pieces_of([], None), None
    if shard is not None and store is not None:
        try:  # the next step's error for a replaced weight it would refuse, raised by agree
            refuse_replaced_cache(name, store, block.table.weight)  # else: the old rows
            held = store.checkpoint_chunks(None)  # in memory: the weight the table holds now
        except BuilderError as error:
            refused = error
        else:
            chunks = [(shard.row_start + start, rows) for start, rows in held]
            pieces = pieces_of(chunks, store.drop_pages)  # a disk tier's: a file chunk at a time
    if placement.sharding == "data_parallel":
        return RankedTable(config, emb.device, pieces, refused=refused)
    return RankedTable(config, emb.device, pieces, emb.strategy, emb.mesh.shard, refused)


def pieces_of(
    chunks: list[tuple[int, torch.Tensor]], drop_pages: Callable[[], None] | None
) -> Chunks:
    def pieces(rows: int) -> Iterator[tuple[int, torch.Tensor]]:
        for first, block in chunks:
            for start in range(0, block.shape[0], rows):
                if drop_pages is not None:
                    drop_pages()
                yield first + start, block[start : start + rows].detach()
        if drop_pages is not None:
            drop_pages()

    return pieces


def gather(where: RankedTable, tensor: torch.Tensor, batches: list[int]) -> torch.Tensor:
    if where.strategy is None:
        return tensor
    parts = all_gather_uneven(where.strategy, tensor, group=where.group, lengths=batches)
    return torch.cat(parts)


def sum_over(where: RankedTable, tensor: torch.Tensor, what: str) -> torch.Tensor:
    if where.strategy is None:
        return tensor
    name = f"ranking table {where.config.name!r}: {what}"
    return where.strategy.all_reduce_(tensor, "sum", name=name, group=where.group)


def mine(where: RankedTable, tensor: torch.Tensor, batches: list[int]) -> torch.Tensor:
    """This rank's rows of a tensor over every rank's queries."""
    if where.strategy is None:
        return tensor
    index = where.strategy.group_rank(where.group)
    start = sum(batches[:index])
    return tensor[start : start + batches[index]]
