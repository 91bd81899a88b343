"""Saving a checkpoint: sharded (torch.distributed.checkpoint) or full, committed atomically.

Layout of a sharded checkpoint directory:

    step_100/
        manualpar.json          manifest, written last; its presence marks a committed checkpoint
        .metadata, *.distcp     tensors, written by torch.distributed.checkpoint (reshardable)
        objects/replicated.pt   non-tensor leaves (rank 0's copy), weights-only
        objects/rank_<r>.pt     per-rank entries (e.g. RNGState), weights-only

Every rank writes into `.step_100.partial/`; rank 0 renames it to `step_100/` only after every
rank reported success, so a crash at any point leaves the previous checkpoint untouched and the
partial one invisible to `latest_checkpoint` and `load_checkpoint`. A shared filesystem is assumed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from manualpar.checkpoint.agreement import Ranks, agree, agree_on_path, dcp_call
from manualpar.checkpoint.files import (
    FORMAT,
    FULL_KEY,
    MANIFEST,
    check_free_space,
    partial_path,
    prepare,
    swap_in,
    write_file,
)
from manualpar.checkpoint.records import MANIFEST_KEY as RECORDS
from manualpar.checkpoint.records import saved_records
from manualpar.checkpoint.state import (
    entry_kind,
    entry_state_dict,
    flatten,
    split_leaves,
    to_safe_bytes,
    validate_state,
)

__all__ = [
    "commit",
    "make_manifest",
    "save_checkpoint",
    "serialize_objects",
    "state_dicts",
    "write_blobs",
]

log = logging.getLogger("manualpar.checkpoint")


def state_dicts(state: Mapping[str, Any], *, full: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat leaves of the shared entries and of the per-rank entries."""
    shared: dict[str, Any] = {}
    per_rank: dict[str, Any] = {}
    for key, value in state.items():
        if entry_kind(value) == "record":  # no leaves: its record is in the manifest
            continue
        target = per_rank if entry_kind(value) == "per_rank" else shared
        target.update(flatten(entry_state_dict(key, value, state, full=full), key))
    return shared, per_rank


def make_manifest(strategy: Ranks, state: Mapping[str, Any], kind: str) -> dict:
    step = state.get("step")
    return {
        "format": FORMAT,
        "version": 1,
        "kind": kind,
        "world_size": strategy.world_size,
        "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
        "entries": {key: entry_kind(value) for key, value in state.items()},
        RECORDS: saved_records(state),
        "committed_at": time.time(),
        "torch": str(torch.__version__),
    }


def save_checkpoint(
    strategy: Ranks,
    path: str | os.PathLike,
    state: Mapping[str, Any],
    *,
    full: bool = False,
    overwrite: bool = True,
) -> Path:
    """Save `state` (collective: call on every rank with the same keys). Returns the path.

    Sharded (default): a directory any world size can load. `full=True`: one file written by
    rank 0 that plain `torch.load(path, weights_only=True)` reads.
    """
    path = Path(path).absolute()
    validate_state(state)
    agree_on_path(strategy, "save_checkpoint", path)
    started = time.perf_counter()
    if full:
        _save_full(strategy, path, state, overwrite)
    else:
        _save_sharded(strategy, path, state, overwrite)
    if strategy.is_global_zero:
        log.info("saved checkpoint %s in %.2fs", path, time.perf_counter() - started)
    return path


def _save_sharded(strategy: Ranks, path: Path, state: Mapping[str, Any], overwrite: bool) -> None:
    import torch.distributed.checkpoint as dcp

    from manualpar.checkpoint.writer import NamingWriter  # with DCP: imported when saving

    staging = partial_path(path)
    shared, per_rank = state_dicts(state, full=False)
    tensors, objects = split_leaves(shared)
    # Global shapes (DTensor and LocalShards report them too): what all ranks write together.
    needed = sum(math.prod(t.shape) * t.element_size() for t in tensors.values())
    agree(
        strategy,
        f"preparing checkpoint {path}",
        lambda: (
            prepare(path, staging, overwrite, make_dir=True, needed=needed)
            if strategy.is_global_zero
            else None
        ),
    )
    dcp_call(
        strategy,
        f"save_checkpoint({path}): writing tensor shards",
        lambda: dcp.save(
            tensors, storage_writer=NamingWriter(staging), process_group=strategy.group
        ),
    )

    agree(
        strategy,
        f"save_checkpoint({path}): writing objects",
        lambda: write_blobs(staging, serialize_objects(strategy, objects, per_rank)),
    )
    commit(strategy, path, staging, make_manifest(strategy, state, "sharded"))


def serialize_objects(
    strategy: Ranks, objects: Mapping[str, Any], per_rank: Mapping[str, Any]
) -> dict[str, bytes]:
    """The object files' bytes by name under `objects/` (this rank's entries; rank 0 also the
    replicated ones). A background save makes them when it starts: a snapshot of the values."""
    blobs = {}
    if per_rank:
        blobs[f"rank_{strategy.rank}.pt"] = to_safe_bytes(
            per_rank, f"per-rank entries on rank {strategy.rank}"
        )
    if strategy.is_global_zero:
        blobs["replicated.pt"] = to_safe_bytes(objects, "checkpoint state")
    return blobs


def write_blobs(staging: Path, blobs: Mapping[str, bytes]) -> None:
    for name, blob in blobs.items():
        write_file(staging / "objects" / name, blob)


def commit(strategy: Ranks, path: Path, staging: Path, manifest: dict[str, Any]) -> None:
    """Rank 0 writes the manifest and renames the staging copy into place; called once every
    rank reported its files written (the agreement before it), so only a complete copy is
    ever renamed in."""

    def swap() -> None:
        if strategy.is_global_zero:
            manifest["committed_at"] = time.time()
            write_file(staging / MANIFEST, json.dumps(manifest, indent=2).encode())
            swap_in(staging, path)

    agree(strategy, f"save_checkpoint({path}): commit", swap)


def _save_full(strategy: Ranks, path: Path, state: Mapping[str, Any], overwrite: bool) -> None:
    staging = partial_path(path)
    agree(
        strategy,
        f"preparing checkpoint {path}",
        lambda: (
            prepare(path, staging, overwrite, make_dir=False) if strategy.is_global_zero else None
        ),
    )
    blob: dict[str, Any] = {}
    for key, value in state.items():
        if entry_kind(value) == "record":
            continue
        local = entry_state_dict(key, value, state, full=True)
        if entry_kind(value) == "per_rank":
            gathered = strategy.all_gather_object(local)
            local = {f"rank_{rank}": item for rank, item in enumerate(gathered)}
        blob[key] = local
    blob[FULL_KEY] = make_manifest(strategy, state, "full")

    def write() -> None:
        if strategy.is_global_zero:
            data = to_safe_bytes(blob, "checkpoint state")
            check_free_space(path.parent, len(data), path)
            write_file(staging, data)
            swap_in(staging, path)

    agree(strategy, f"save_checkpoint({path}, full=True)", write)
