"""Sharding plans: where each table's rows and columns live. Plain, printable, serializable.

    plan = EmbeddingPlan(world_size=2, tables={
        "user": table_wise(rank=0),
        "item": row_wise(),                 # rows split over all ranks
        "ad": column_wise(ranks=(0, 1)),    # column block i on ranks[i]
        "site": table_row_wise(node=0, ranks_per_node=2),
        "country": data_parallel(),         # small table replicated on every rank
    })
    print(plan); plan.to_json()

A plan is checked against the tables and the world size before anything is allocated: a table
left out, an unknown table, a rank that does not exist all raise PlanError. Rows and columns are
split as evenly as possible, the first blocks taking the remainder.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from manualpar.embeddings.config import ROW_WISE_STATE, EmbeddingBagConfig, block_bytes
from manualpar.embeddings.dtype_names import dtype_name
from manualpar.embeddings.exchange_layout import (
    WireDtypes,
    wire_from_dict,
    wire_name,
    wire_to_dict,
)
from manualpar.embeddings.plan_text import per_rank_text, shards_text
from manualpar.embeddings.row_blocks import row_blocks, split_evenly
from manualpar.environment import detect_environment
from manualpar.errors import PlanError

__all__ = [
    "SHARDING_TYPES",
    "EmbeddingPlan",
    "Shard",
    "TablePlacement",
    "column_wise",
    "data_parallel",
    "format_bytes",
    "on_disk",
    "row_wise",
    "split_evenly",
    "table_row_wise",
    "table_wise",
]

# The placement kinds of a TablePlacement (`kind`), as written in plans and their JSON.
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")


def format_bytes(size: float) -> str:
    """A size in the largest unit that keeps it >= 1 (GiB, MiB, KiB, bytes)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}" if unit == "GiB" else f"{size / scale:.1f} {unit}"
    return f"{int(size)} bytes"


@dataclass(frozen=True)
class Shard:
    """Rows [row_start, row_end) x columns [col_start, col_end) of a table, held by `rank`."""

    rank: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    replicated: bool = False  # data-parallel: every rank holds the whole table

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def cols(self) -> int:
        return self.col_end - self.col_start


@dataclass(frozen=True)
class TablePlacement:
    """How one table is placed; build with table_wise(), row_wise(), ... rather than directly.

    `ranks` is empty for data_parallel and for row_wise over all ranks. `on_disk`: the block's
    rows live in files with a cache in memory (disk_tier.py; `row_wise(on_disk=True)`).
    """

    sharding: str
    ranks: tuple[int, ...] = ()
    on_disk: bool = False

    def __post_init__(self) -> None:
        if self.sharding not in SHARDING_TYPES:
            raise PlanError(f"sharding must be one of {SHARDING_TYPES}, got {self.sharding!r}")
        object.__setattr__(self, "ranks", _ranks(self.sharding, self.ranks))
        if self.on_disk and self.sharding == "data_parallel":
            raise PlanError("data_parallel tables are replicated in memory; they cannot be on_disk")

    def resolved_ranks(self, world_size: int) -> tuple[int, ...]:
        if self.sharding in ("row_wise", "data_parallel") and not self.ranks:
            return tuple(range(world_size))
        return self.ranks

    def __str__(self) -> str:
        disk = " on disk" if self.on_disk else ""
        return f"{self.sharding}{list(self.ranks) if self.ranks else ''}{disk}"


def _ranks(sharding: str, ranks: Sequence[int]) -> tuple[int, ...]:
    """Plain ints (numpy/torch integers accepted); a float, string or bool is a mistake."""
    try:
        if any(isinstance(r, bool) for r in ranks):
            raise TypeError("bool")
        return tuple(operator.index(r) for r in ranks)
    except TypeError:
        raise PlanError(f"{sharding}: ranks must be integers, got {list(ranks)!r}") from None


def table_wise(rank: int, *, on_disk: bool = False) -> TablePlacement:
    """The whole table on one rank. `on_disk` (here and below): its rows live in files on that
    rank, cached in memory (shard_embeddings(disk_tier=...))."""
    return TablePlacement("table_wise", (rank,), on_disk)


def row_wise(ranks: Sequence[int] | None = None, *, on_disk: bool = False) -> TablePlacement:
    """Rows split evenly over `ranks` (default: every rank)."""
    return TablePlacement("row_wise", tuple(ranks or ()), on_disk)


def column_wise(ranks: Sequence[int], *, on_disk: bool = False) -> TablePlacement:
    """Columns split evenly into len(ranks) blocks; block i (all rows) on ranks[i]."""
    return TablePlacement("column_wise", tuple(ranks), on_disk)


def table_row_wise(
    node: int, ranks_per_node: int | None = None, *, on_disk: bool = False
) -> TablePlacement:
    """Rows split over the ranks of one node: row-wise traffic stays on the node's fast links.
    `ranks_per_node` defaults to the launcher's processes per node (LOCAL_WORLD_SIZE, SLURM's
    or MPI's equivalent), the layout the strategy reads."""
    if ranks_per_node is None:
        ranks_per_node = detect_environment().local_world_size
    start = node * ranks_per_node
    return TablePlacement("table_row_wise", tuple(range(start, start + ranks_per_node)), on_disk)


def on_disk(placement: TablePlacement) -> TablePlacement:
    """`placement` with its rows on disk: the spelling before 0.3, which
    `manualpar.embeddings.on_disk` still gives with a warning (row_wise(on_disk=True), ...)."""
    return TablePlacement(placement.sharding, placement.ranks, on_disk=True)


def data_parallel() -> TablePlacement:
    """A full replica on every rank; gradients all-reduced. Only for small tables."""
    return TablePlacement("data_parallel")


@dataclass(frozen=True)
class EmbeddingPlan:
    """Where each table lives on `world_size` ranks: table name -> TablePlacement, with the
    planner's `notes`; `describe(configs)` prints it, `to_json`/`from_json` store it.
    `wire`: the dtypes the collection's exchanges travel in, where the planner chose them
    (PlanConstraints.wire_dtypes), and `wire_note` why; shard_embeddings uses them unless
    given its own wire_dtype= (None: float32)."""

    world_size: int
    tables: Mapping[str, TablePlacement] = field(default_factory=dict)
    notes: Mapping[str, str] = field(default_factory=dict)  # why the planner chose each placement
    wire: WireDtypes | None = None
    wire_note: str = ""

    def __post_init__(self) -> None:
        if (
            isinstance(self.world_size, bool)
            or not isinstance(self.world_size, int)
            or self.world_size < 1
        ):
            raise PlanError(f"a plan's world_size must be an int >= 1, got {self.world_size!r}")
        object.__setattr__(self, "tables", dict(self.tables))
        object.__setattr__(self, "notes", dict(self.notes))

    # checks -----------------------------------------------------------------------------------
    def validate(self, configs: Sequence[EmbeddingBagConfig], world_size: int) -> None:
        """Raise PlanError unless the plan places exactly these tables on existing ranks."""
        if self.world_size != world_size:
            raise PlanError(
                f"this plan was made for world size {self.world_size}, but the job has "
                f"{world_size} ranks; make a plan for {world_size} ranks (plan='auto' does)"
            )
        names = [c.name for c in configs]
        missing = [n for n in names if n not in self.tables]
        if missing:
            raise PlanError(
                f"the plan leaves out tables {missing}; every table needs a "
                "placement (tables are never dropped silently)"
            )
        unknown = sorted(set(self.tables) - set(names))
        if unknown:
            raise PlanError(
                f"the plan places tables {unknown} that the collection does not "
                f"have; remove them or fix their names (its tables are {names})"
            )
        for config in configs:
            self._check_placement(config, self.tables[config.name], world_size)

    @staticmethod
    def _check_placement(
        config: EmbeddingBagConfig, placement: TablePlacement, world_size: int
    ) -> None:
        ranks = placement.resolved_ranks(world_size)
        where = f"table {config.name!r} ({placement})"
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            needed = max(bad) + 1
            launch = (
                f", or launch the job on at least {needed} ranks (one node: torchrun "
                f"--nproc-per-node {needed})"
                if needed > world_size
                else ""
            )
            raise PlanError(
                f"{where}: ranks {bad} do not exist in a job of {world_size} ranks; "
                f"use ranks in [0, {world_size}){launch}"
            )
        if len(set(ranks)) != len(ranks):
            raise PlanError(f"{where}: a rank appears twice; give each block its own rank")
        if placement.sharding == "table_wise" and len(ranks) != 1:
            raise PlanError(f"{where}: table_wise takes exactly one rank")
        if placement.sharding in ("column_wise", "table_row_wise") and not ranks:
            raise PlanError(f"{where}: needs at least one rank")
        if placement.sharding in ("row_wise", "table_row_wise") and config.num_embeddings < len(
            ranks
        ):
            raise PlanError(
                f"{where}: {config.num_embeddings} rows cannot be split over "
                f"{len(ranks)} ranks; use table_wise"
            )
        if placement.sharding == "column_wise" and config.embedding_dim < len(ranks):
            raise PlanError(
                f"{where}: {config.embedding_dim} columns cannot be split over {len(ranks)} ranks"
            )

    # shards -----------------------------------------------------------------------------------
    def shards(self, config: EmbeddingBagConfig) -> list[Shard]:
        """The blocks of one table, in row-major block order."""
        placement = self.tables[config.name]
        ranks = placement.resolved_ranks(self.world_size)
        rows, dim = config.num_embeddings, config.embedding_dim
        if placement.sharding == "data_parallel":
            return [Shard(r, 0, rows, 0, dim, replicated=True) for r in ranks]
        if placement.sharding == "column_wise":
            return [
                Shard(r, 0, rows, c0, c1)
                for r, (c0, c1) in zip(ranks, split_evenly(dim, len(ranks)), strict=True)
            ]
        return [
            Shard(r, r0, r1, 0, dim)
            for r, (r0, r1) in zip(ranks, row_blocks(config, len(ranks)), strict=True)
        ]

    def bytes_per_rank(
        self, configs: Sequence[EmbeddingBagConfig], state: Mapping[str, bool] = ROW_WISE_STATE
    ) -> list[int]:
        """Weight plus optimizer-state bytes on each rank (`state`: the update rule's STATE;
        default row-wise Adagrad's one float per row)."""
        total = [0] * self.world_size
        for config in configs:
            for shard in self.shards(config):
                total[shard.rank] += block_bytes(shard.rows, shard.cols, state, config.dtype)
        return total

    # presentation -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "tables": {
                name: {"sharding": p.sharding, "ranks": list(p.ranks)}
                | ({"on_disk": True} if p.on_disk else {})
                for name, p in self.tables.items()
            },
            "notes": dict(self.notes),
        } | (
            {"wire": wire_to_dict(self.wire), "wire_note": self.wire_note}
            if self.wire is not None
            else {}
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EmbeddingPlan:
        wire = wire_from_dict(data["wire"]) if "wire" in data else None
        try:
            return cls(
                int(data["world_size"]),
                {
                    name: TablePlacement(
                        p["sharding"], tuple(p.get("ranks", ())), bool(p.get("on_disk", False))
                    )
                    for name, p in data["tables"].items()
                },
                dict(data.get("notes", {})),
                wire,
                str(data.get("wire_note", "")),
            )
        except (KeyError, TypeError) as error:
            raise PlanError(
                f"not a plan: {error!r}; expected {{'world_size': N, 'tables': "
                "{name: {'sharding': ..., 'ranks': [...]}}}"
            ) from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> EmbeddingPlan:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise PlanError(f"a plan must be JSON from EmbeddingPlan.to_json(): {error}") from None
        if not isinstance(data, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def describe(self, configs: Sequence[EmbeddingBagConfig]) -> str:
        """A table: placement, shards and bytes per rank (what `print(plan)` shows, with sizes)."""
        lines = [f"embedding plan for {self.world_size} ranks"]
        for config in configs:
            shards = (
                shards_text(self.shards(config), config.embedding_dim)
                if config.name in self.tables
                else "-"
            )
            note = f"  ({self.notes[config.name]})" if config.name in self.notes else ""
            dtype = "" if config.dtype == torch.float32 else f"{dtype_name(config.dtype)} "
            lines.append(
                f"  {config.name:<16} {config.num_embeddings:>12} x "
                f"{config.embedding_dim:<4} {dtype}{self.tables[config.name]!s:<22} "
                f"{shards}{note}"
            )
        per_rank = self.bytes_per_rank(configs)
        lines.append(
            "  bytes per rank (weights + row-wise state): " + per_rank_text(per_rank, format_bytes)
        )
        disk = [c for c in configs if c.name in self.tables and self.tables[c.name].on_disk]
        if disk:  # those blocks are files; memory holds their caches (disk_tier.py)
            on_disk = EmbeddingPlan(self.world_size, self.tables).bytes_per_rank(disk)
            lines.append("  of which on disk: " + per_rank_text(on_disk, format_bytes))
        if self.wire is not None:
            why = f" ({self.wire_note})" if self.wire_note else ""
            lines.append(f"  exchanges in {wire_name(self.wire)}{why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        body = ", ".join(f"{name}: {p}" for name, p in self.tables.items())
        return f"EmbeddingPlan(world_size={self.world_size}, {body})"
