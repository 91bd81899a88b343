"""A TorchRec sharding plan, described as plain data, turned into manualpar's plan JSON.

Imports neither torch, TorchRec nor manualpar, so both sides use it: peer_torchrec_planner.py
(in TorchRec's environment) describes each table's shards and calls `to_manualpar_plan`; the
tests check the conversion without TorchRec installed.

    table = {"name": "cat_0", "num_embeddings": 40, "embedding_dim": 8,
             "sharding_type": "row_wise",
             "shards": [{"rank": 0, "offset": [0, 0], "size": [20, 8]},
                        {"rank": 1, "offset": [20, 0], "size": [20, 8]}]}
    plan = to_manualpar_plan(world_size=2, ranks_per_node=2, tables=[table])
    # {"world_size": 2, "tables": {"cat_0": {"sharding": "row_wise", "ranks": []}},
    #  "notes": {"cat_0": "torchrec row_wise"}}

Kinds map one to one where manualpar has the same layout: table_wise -> [rank], row_wise over
every rank -> [], table_row_wise over one node's ranks -> the node's ranks, column_wise -> the
ranks of its column blocks in column order, data_parallel -> []. Where TorchRec's shards cannot
be written exactly (blocks of other sizes than manualpar's even split, ranks holding no rows, a
rank holding two column blocks, kinds manualpar lacks), the nearest manualpar placement is used
and the table's note says what differs, starting with "approximate:".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ConversionError", "split_evenly", "to_manualpar_placement", "to_manualpar_plan"]


class ConversionError(ValueError):
    """The description is not a plan of these tables (a shard off the table, a bad rank)."""


def split_evenly(total: int, parts: int) -> list[int]:
    """Block sizes of manualpar's even split: `parts` near-equal blocks, the first ones larger."""
    base, extra = divmod(total, parts)
    return [base + (index < extra) for index in range(parts)]


def _blocks(shards: Sequence[Mapping[str, Any]], axis: int) -> list[tuple[int, int, int]]:
    """(offset, size, rank) of each shard along `axis` (0 rows, 1 columns), in offset order."""
    return sorted((int(s["offset"][axis]), int(s["size"][axis]), int(s["rank"])) for s in shards)


def _check(table: Mapping[str, Any], world_size: int) -> None:
    name, shards = table["name"], table["shards"]
    if not shards:
        raise ConversionError(f"table {name!r}: no shards")
    for shard in shards:
        rank = int(shard["rank"])
        if not 0 <= rank < world_size:
            raise ConversionError(f"table {name!r}: rank {rank} outside [0, {world_size})")
        for axis, extent in enumerate((table["num_embeddings"], table["embedding_dim"])):
            start, size = int(shard["offset"][axis]), int(shard["size"][axis])
            if start < 0 or size < 0 or start + size > extent:
                raise ConversionError(
                    f"table {name!r}: shard {shard} runs past the table ({extent} along axis "
                    f"{axis})"
                )


def _split(
    blocks: list[tuple[int, int, int]], extent: int, what: str
) -> tuple[list[int], list[str]]:
    """The ranks holding a non-empty block, in offset order, and what differs from manualpar's
    even split of `extent` over them."""
    held = [(start, size, rank) for start, size, rank in blocks if size > 0]
    ranks = [rank for _, _, rank in held]
    differs = []
    empty = [rank for _, size, rank in blocks if size == 0]
    if empty:
        differs.append(f"ranks {empty} hold no {what}, so they are left out")
    if len(set(ranks)) != len(ranks):
        differs.append(f"a rank holds two {what} blocks ({ranks}); each rank kept once")
        ranks = list(dict.fromkeys(ranks))
    sizes = [size for _, size, _ in held]
    if sum(sizes) != extent:
        differs.append(f"its {what} blocks cover {sum(sizes)} of {extent}")
    elif len(sizes) == len(ranks) and sizes != split_evenly(extent, len(ranks)):
        even = split_evenly(extent, len(ranks))
        differs.append(
            f"{what} blocks of {_span(sizes)} where manualpar's even split makes {_span(even)}"
        )
    return ranks, differs


def _span(sizes: list[int]) -> str:
    low, high = min(sizes), max(sizes)
    return f"{low}" if low == high else f"{low}..{high}"


def to_manualpar_placement(
    table: Mapping[str, Any], world_size: int, ranks_per_node: int
) -> tuple[dict[str, Any], str]:
    """({"sharding", "ranks"}, note) for one table described as in the module docstring."""
    _check(table, world_size)
    kind, shards = table["sharding_type"], table["shards"]
    rows, dim = int(table["num_embeddings"]), int(table["embedding_dim"])
    note = f"torchrec {kind}"
    if table.get("compute_kernel"):
        note += f", {table['compute_kernel']} kernel"
    differs: list[str] = []
    if kind == "data_parallel":
        placement: dict[str, Any] = {"sharding": "data_parallel", "ranks": []}
    elif kind == "table_wise" and len(shards) == 1:
        placement = {"sharding": "table_wise", "ranks": [int(shards[0]["rank"])]}
    elif kind in ("row_wise", "table_row_wise"):
        ranks, differs = _split(_blocks(shards, 0), rows, "row")
        node_of = {rank // ranks_per_node for rank in ranks}
        node = min(node_of)
        node_ranks = list(range(node * ranks_per_node, (node + 1) * ranks_per_node))
        if len(ranks) == 1:
            placement = {"sharding": "table_wise", "ranks": ranks}
        elif ranks == list(range(world_size)):
            placement = {"sharding": "row_wise", "ranks": []}
        elif ranks == node_ranks:
            placement = {"sharding": "table_row_wise", "ranks": ranks}
        else:
            placement = {"sharding": "row_wise", "ranks": ranks}
            differs.append(f"rows on ranks {ranks} only: written as row_wise over them")
    elif kind in ("column_wise", "table_column_wise") or kind == "table_wise":
        ranks, differs = _split(_blocks(shards, 1), dim, "column")
        if len(ranks) == 1:
            placement = {"sharding": "table_wise", "ranks": ranks}
        else:
            placement = {"sharding": "column_wise", "ranks": ranks}
    else:  # e.g. grid_shard: rows and columns both split; nearest: rows over its ranks
        ranks = list(dict.fromkeys(rank for _, _, rank in _blocks(shards, 0)))
        placement = (
            {"sharding": "table_wise", "ranks": ranks}
            if len(ranks) == 1
            else {"sharding": "row_wise", "ranks": ranks}
        )
        differs.append(f"manualpar has no {kind}: written as {placement['sharding']}")
    if differs:
        note = f"approximate: {note}; " + "; ".join(differs)
    return placement, note


def to_manualpar_plan(
    world_size: int,
    ranks_per_node: int,
    tables: Sequence[Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """manualpar's plan JSON ({"world_size", "tables", "notes"}, EmbeddingPlan.from_dict reads
    it) for TorchRec's shards of `tables`; `extra` keys are added alongside (from_dict ignores
    them)."""
    if world_size < 1 or ranks_per_node < 1 or world_size % ranks_per_node:
        raise ConversionError(
            f"ranks_per_node {ranks_per_node} must divide world_size {world_size}"
        )
    placements, notes = {}, {}
    for table in tables:
        placements[table["name"]], notes[table["name"]] = to_manualpar_placement(
            table, world_size, ranks_per_node
        )
    return {"world_size": world_size, "tables": placements, "notes": notes, **(extra or {})}
