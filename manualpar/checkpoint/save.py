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
import torch.distributed.checkpoint as dcp

from manualpar.checkpoint.agreement import Ranks, agree, dcp_call
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
from manualpar.checkpoint.state import (
    entry_kind,
    entry_state_dict,
    flatten,
    split_leaves,
    to_safe_bytes,
    validate_state,
)

__all__ = ["save_checkpoint", "state_dicts"]

log = logging.getLogger("manualpar.checkpoint")


def state_dicts(state: Mapping[str, Any], *, full: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat leaves of the shared entries and of the per-rank entries."""
    shared: dict[str, Any] = {}
    per_rank: dict[str, Any] = {}
    for key, value in state.items():
        target = per_rank if entry_kind(value) == "per_rank" else shared
        target.update(flatten(entry_state_dict(key, value, state, full=full), key))
    return shared, per_rank


def _manifest(strategy: Ranks, state: Mapping[str, Any], kind: str) -> dict:
    step = state.get("step")
    return {
        "format": FORMAT,
        "version": 1,
        "kind": kind,
        "world_size": strategy.world_size,
        "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
        "entries": {key: entry_kind(value) for key, value in state.items()},
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
    started = time.perf_counter()
    if full:
        _save_full(strategy, path, state, overwrite)
    else:
        _save_sharded(strategy, path, state, overwrite)
    if strategy.is_global_zero:
        log.info("saved checkpoint %s in %.2fs", path, time.perf_counter() - started)
    return path


def _save_sharded(strategy: Ranks, path: Path, state: Mapping[str, Any], overwrite: bool) -> None:
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
            tensors, storage_writer=dcp.FileSystemWriter(staging), process_group=strategy.group
        ),
    )

    def write_objects() -> None:
        if per_rank:
            blob = to_safe_bytes(per_rank, f"per-rank entries on rank {strategy.rank}")
            write_file(staging / "objects" / f"rank_{strategy.rank}.pt", blob)
        if strategy.is_global_zero:
            write_file(
                staging / "objects" / "replicated.pt", to_safe_bytes(objects, "checkpoint state")
            )

    agree(strategy, f"save_checkpoint({path}): writing objects", write_objects)

    def commit() -> None:
        if strategy.is_global_zero:
            manifest = json.dumps(_manifest(strategy, state, "sharded"), indent=2).encode()
            write_file(staging / MANIFEST, manifest)
            swap_in(staging, path)

    agree(strategy, f"save_checkpoint({path}): commit", commit)


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
        local = entry_state_dict(key, value, state, full=True)
        if entry_kind(value) == "per_rank":
            gathered = strategy.all_gather_object(local)
            local = {f"rank_{rank}": item for rank, item in enumerate(gathered)}
        blob[key] = local
    blob[FULL_KEY] = _manifest(strategy, state, "full")

    def write() -> None:
        if strategy.is_global_zero:
            data = to_safe_bytes(blob, "checkpoint state")
            check_free_space(path.parent, len(data), path)
            write_file(staging, data)
            swap_in(staging, path)

    agree(strategy, f"save_checkpoint({path}, full=True)", write)
