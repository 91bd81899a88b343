"""The managed-collision remapper of a sharded collection: its buckets split over the job.

ShardedManagedCollisions is a sharded collection's RawIdRemap (ids/remap.py). Each managed
table takes one of two paths, chosen per table by ids/buckets.py's `owner_blocks`:

- at its owners, in the step (remap_at_owner.py): a table whose blocks hold whole rows, without
  replicas; each block's owner holds its buckets' state and `owner_remap` hands the step the
  view that remaps them, with no exchange of its own;
- through the remap exchange (this module): any other managed table (columns split,
  replicated, a 2-D layout) has its buckets split over the job: rank r of W remaps buckets
  [r * B // W, (r + 1) * B // W) (B buckets) and holds their rows' state. Each step every rank
  sends the distinct raw ids of its batch (with their counts) to their buckets' owners, the
  owners remap the union as the single-process remapper would remap the global batch
  (ids/managed_table.py: everything is per bucket, and the order within a bucket does not
  depend on the senders), and send the rows back. Three all_to_alls over the whole job per
  step, for those tables together: sizes, ids and counts, rows. Every replica of a 2-D layout
  sees the same mapping.

A pipeline's prefetch runs the first two (`send`: nothing is remapped), so a batch's ids travel
during the previous step; the remap and the rows wait for that batch's forward (`finish`), so
the state, and a checkpoint taken with a batch in flight, never run a batch ahead.

The state is checkpointed per row as LocalShards (like the fused optimizer's per-row state), so
it reshards on load to any world size; `step` is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from manualpar.checkpoint.local_shards import Block, LocalShards, gathering_full_tensors
from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.features import SparseFeatures
from manualpar.embeddings.ids.buckets import (
    STATE,
    buckets_of,
    layout_of,
    managed_setting,
    managed_tables,
)
from manualpar.embeddings.ids.hashing import salt_key, table_ids, with_table_ids
from manualpar.embeddings.ids.managed_collisions import (
    ManagedCollisionRemapper,
    ManagedCollisionTable,
)
from manualpar.embeddings.ids.remap import OwnerRemap, RemapSent
from manualpar.embeddings.kernels.native import loaded_kernels, native_kernels_take
from manualpar.embeddings.sharded.remap_at_owner import RemapAtOwner
from manualpar.embeddings.step.size_header import REFUSED, check_refusals

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy, PendingCollective

__all__ = ["RemapInFlight", "ShardedManagedCollisions", "sharded_remapper"]

WHAT = "shard_embeddings: managed-collision"


class ShardedManagedCollisions(ManagedCollisionRemapper):
    """This rank's buckets of every managed table, a RawIdRemap (ids/remap.py). Forward remaps
    the exchanged tables with the other ranks; the step remaps the `at_owner` ones
    (remapped_at_owner, remap_at_owner.py) through `owner_remap`."""

    def __init__(
        self,
        configs: Sequence[EmbeddingBagConfig],
        strategy: ManualParallelStrategy,
        source: ManagedCollisionRemapper | None,
        at_owner: Mapping[str, Mapping[int, tuple[int, int]]] | None = None,
    ) -> None:
        super().__init__([], strategy.device)
        self.configs, self.strategy = tuple(configs), strategy
        # table -> {job rank: its buckets [first, end)}, for the tables remapped in the step
        self.at_owner = {name: dict(ranks) for name, ranks in (at_owner or {}).items()}
        rank, world = strategy.rank, strategy.world_size
        for config in managed_tables(configs):
            buckets = self._buckets(config, rank, world)
            table = ManagedCollisionTable(config, buckets, strategy.device)
            if source is not None:
                _copy_block(source.table(config.name), table)
            table._register_state_dict_hook(self._state_dict_hook)
            table._register_load_state_dict_pre_hook(self._load_pre_hook)
            self.tables[config.name] = table
        # the tables remapped through this module's exchange (the others: in the step)
        self.exchanged = [c for c in managed_tables(configs) if c.name not in self.at_owner]
        # per table, the end of each rank's buckets (where the ids of a bucket are sent)
        self._owner_ends = {
            c.name: torch.tensor([layout_of(c).owned(r, world)[1] for r in range(world)])
            for c in self.exchanged
        }

    def _buckets(self, config: EmbeddingBagConfig, rank: int, world: int) -> tuple[int, int]:
        """The buckets `rank` holds: its block's, or none, of a table remapped at its owners."""
        layout, owners = layout_of(config), self.at_owner.get(config.name)
        if owners is None:
            return layout.owned(rank, world)
        every = layout.num_buckets
        return owners.get(rank, (every, every))

    @property
    def exchanges(self) -> bool:
        """Whether a forward runs this module's exchange (some table is not remapped at its
        owner): a pipeline sends such a batch's raw ids ahead (`send`)."""
        return bool(self.exchanged)

    def owner_remap(self, names: Sequence[str]) -> OwnerRemap | None:
        """What the step of a collection whose tables are `names` (in its routing's order)
        calls to remap the `at_owner` tables (None: there are none)."""
        if not self.at_owner:
            return None
        at_owner = {t: name for t, name in enumerate(names) if name in self.at_owner}
        return RemapAtOwner(self.table, at_owner)

    # forward ----------------------------------------------------------------------------------
    def forward(self, features: SparseFeatures) -> SparseFeatures:
        """`features` with row ids for the exchanged tables (the others: in the step)."""
        if not self.exchanged:
            return features
        return self.finish(self.send(features))

    def send(self, features: SparseFeatures) -> RemapInFlight:
        """Route this rank's raw ids to their buckets' owners: the sizes exchange (blocking),
        then the ids, in flight on return. Nothing is remapped yet, so no state changes: a
        pipeline sends the next batch's ids while the current batch's step runs."""
        world = self.strategy.world_size
        names = [c.name for c in self.exchanged]
        raw = table_ids(features, self.configs, self.exchanged)
        sends = [
            _Sent(raw[name], self.table(name).config, self._owner_ends, self.table(name).native)
            for name in names
        ]
        sizes_out = [[sent.per_rank[r] for sent in sends] for r in range(world)]  # [owner][table]
        header = torch.tensor([[0, *sizes] for sizes in sizes_out], device=self.device)
        got = self._exchange_headers(header).tolist()
        check_refusals(got)
        sizes_in = [sizes[1:] for sizes in got]  # [sender][table]
        payload = torch.cat(
            [part for owner in range(world) for sent in sends for part in sent.to_owner(owner)]
            or [header.new_zeros(0)]
        )
        received = self.strategy.all_to_all_async(
            payload,
            [2 * sum(s) for s in sizes_out],
            [2 * sum(s) for s in sizes_in],
            name=f"{WHAT} ids all_to_all",
        )
        return RemapInFlight(features, names, sends, sizes_out, sizes_in, received)

    def finish(self, sent: RemapSent) -> SparseFeatures:
        """Remap the ids `send` routed (this rank's buckets of every rank's batch: the state
        moves one step) and return each rank its rows: `features` with row ids."""
        assert isinstance(sent, RemapInFlight), type(sent)  # what `send` returned
        names = sent.names
        replies = self._remap_received(names, sent.received.wait(), sent.sizes_in)
        rows = self._all_to_all(
            replies, [sum(s) for s in sent.sizes_in], [sum(s) for s in sent.sizes_out], "rows"
        )
        per_table = _split_by_table(rows, sent.sizes_out)
        mapped = {name: sent.sends[t].rows(per_table[t]) for t, name in enumerate(names)}
        return with_table_ids(sent.features, self.configs, mapped)

    def _remap_received(
        self, names: list[str], received: torch.Tensor, sizes_in: list[list[int]]
    ) -> torch.Tensor:
        """Rows for every sender's ids, sender by sender, table by table."""
        ids_parts: list[list[torch.Tensor]] = [[] for _ in names]
        count_parts: list[list[torch.Tensor]] = [[] for _ in names]
        offset = 0
        for sizes in sizes_in:
            for t, n in enumerate(sizes):
                ids_parts[t].append(received[offset : offset + n])
                count_parts[t].append(received[offset + n : offset + 2 * n])
                offset += 2 * n
        rows_per_table = []
        for t, name in enumerate(names):
            ids, counts = torch.cat(ids_parts[t]), torch.cat(count_parts[t])
            rows = self.table(name).remap_counted(ids, counts)
            rows_per_table.append(rows.split([s[t] for s in sizes_in]))
        return torch.cat(
            [rows_per_table[t][s] for s in range(len(sizes_in)) for t in range(len(names))]
            or [received.new_zeros(0)]
        )

    def _exchange_headers(self, header: torch.Tensor) -> torch.Tensor:
        world, width = header.shape
        received = self.strategy.all_to_all(
            header.flatten(), [width] * world, [width] * world, name=f"{WHAT} sizes all_to_all"
        )
        return received.view(world, width)

    def _all_to_all(
        self, tensor: torch.Tensor, send: list[int], receive: list[int], what: str
    ) -> torch.Tensor:
        return self.strategy.all_to_all(tensor, send, receive, name=f"{WHAT} {what} all_to_all")

    def refuse(self) -> None:
        """This rank's batch failed validation: join the sizes exchange with REFUSED, so every
        rank stops at this step with an error naming this one."""
        if self.strategy.world_size > 1 and self.exchanged:
            world = self.strategy.world_size
            header = torch.full((world, len(self.exchanged) + 1), REFUSED, device=self.device)
            self._exchange_headers(header)

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    # checkpoint -------------------------------------------------------------------------------
    def _block(self, table: ManagedCollisionTable, key: str) -> LocalShards:
        tensor = getattr(table, key)
        rows = (table.config.num_embeddings,)
        blocks = [Block((table.row_start,), tensor)] if tensor.numel() else []
        return LocalShards(rows, blocks, torch.int64)

    def _state_dict_hook(
        self, table: Any, state_dict: dict, prefix: str, local_metadata: Any
    ) -> None:
        for key in STATE:
            shards = self._block(table, key)
            state_dict[prefix + key] = (
                self.strategy.all_reduce_(shards.primary_sum(), "sum", name=f"{WHAT} gather")
                if gathering_full_tensors()
                else shards
            )

    def _load_pre_hook(self, state_dict: dict, prefix: str, *args: Any) -> None:
        table = self.table(prefix.rstrip(".").split(".")[-1])
        for key in STATE:
            value, mine = state_dict.get(prefix + key), getattr(table, key)
            if value is None:
                continue
            if isinstance(value, LocalShards):
                for block in value.blocks:
                    if block.tensor.data_ptr() != mine.data_ptr():
                        mine.copy_(block.tensor)
            else:
                mine.copy_(value.to(mine.device)[table.row_start : table.row_end])
            state_dict[prefix + key] = mine


@dataclass(frozen=True)
class RemapInFlight:
    """A batch whose raw ids `send` routed: the sizes agreed, the ids on their way to their
    buckets' owners, the remap still to come (`finish`)."""

    features: SparseFeatures  # the batch, checked and hashed, with raw ids
    names: list[str]  # the managed tables, in the order of every per-table list
    sends: list[_Sent]  # per table: this rank's distinct ids, ordered by owner
    sizes_out: list[list[int]]  # [owner][table]: distinct ids sent to each owner
    sizes_in: list[list[int]]  # [sender][table]: distinct ids each sender sent here
    received: PendingCollective  # the senders' ids and counts for our buckets

    def settle(self) -> None:
        """Wait for the ids in flight (a dropped batch: nothing was remapped)."""
        self.received.wait()


class _Sent:
    """One table's distinct ids of this rank's batch (with their counts), ordered by owner
    rank; `per_rank[r]` of them go to rank r."""

    def __init__(
        self,
        raw: torch.Tensor,
        config: EmbeddingBagConfig,
        owner_ends: dict[str, torch.Tensor],
        native: bool = True,
    ) -> None:
        layout, ends = layout_of(config), owner_ends[config.name]
        world = ends.numel()
        if native and native_kernels_take(raw):  # one C++ pass (kernels/csrc/raw_ids.cpp)
            salt = salt_key(managed_setting(config).salt)
            self.ids, self.counts, self.inverse, per_rank = loaded_kernels().managed_route(
                raw.to(torch.int64).contiguous(), salt, layout.num_buckets, ends
            )
            self.order: torch.Tensor | None = None
            self.per_rank: list[int] = per_rank.tolist()
            return
        distinct, self.inverse, counts = torch.unique(raw, return_inverse=True, return_counts=True)
        owner = torch.searchsorted(
            ends.to(distinct.device), buckets_of(distinct, config), right=True
        )
        self.order = torch.argsort(owner, stable=True)
        self.ids, self.counts = distinct[self.order], counts[self.order]
        self.per_rank = torch.bincount(owner, minlength=world).tolist()

    def to_owner(self, owner: int) -> list[torch.Tensor]:
        """[ids, counts] going to rank `owner`."""
        start = sum(self.per_rank[:owner])
        end = start + self.per_rank[owner]
        return [self.ids[start:end], self.counts[start:end]]

    def rows(self, owner_ordered: torch.Tensor) -> torch.Tensor:
        """The rows of the raw ids (in their batch order) from the owners' replies."""
        if self.order is None:  # the inverse indexes the owner-ordered ids already
            return owner_ordered[self.inverse]
        distinct_rows = torch.empty_like(owner_ordered)
        distinct_rows[self.order] = owner_ordered
        return distinct_rows[self.inverse]


def _split_by_table(rows: torch.Tensor, sizes_out: list[list[int]]) -> list[torch.Tensor]:
    """The owners' replies (owner by owner, table by table) as one tensor per table."""
    tables = len(sizes_out[0]) if sizes_out else 0
    parts: list[list[torch.Tensor]] = [[] for _ in range(tables)]
    offset = 0
    for sizes in sizes_out:
        for t, n in enumerate(sizes):
            parts[t].append(rows[offset : offset + n])
            offset += n
    return [torch.cat(p) for p in parts]


def _copy_block(source: ManagedCollisionTable, table: ManagedCollisionTable) -> None:
    """A real single-process remapper's state for this block (a meta one: fresh state)."""
    if source.ids.is_meta:
        return
    with torch.no_grad():
        for key in STATE:
            getattr(table, key).copy_(getattr(source, key)[table.row_start : table.row_end])
        table.step.copy_(source.step)


def sharded_remapper(
    configs: Sequence[EmbeddingBagConfig],
    strategy: ManualParallelStrategy,
    source: ManagedCollisionRemapper | None,
    at_owner: Mapping[str, Mapping[int, tuple[int, int]]] | None = None,
) -> ShardedManagedCollisions | None:
    """A sharded collection's remapper (None without managed tables); `at_owner`: the tables
    its step remaps, with each owner's job rank and buckets (remap_at_owner.py)."""
    if not managed_tables(configs):
        return None
    return ShardedManagedCollisions(configs, strategy, source, at_owner)
