"""Checkpoint IO: sharded (torch.distributed.checkpoint) or full, committed atomically.

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
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from manualpar.checkpoint.files import (
    FORMAT,
    FULL_KEY,
    MANIFEST,
    check_free_space,
    latest_checkpoint,
    partial_path,
    prepare,
    read_full,
    read_manifest,
    resolve,
    swap_in,
    write_file,
)
from manualpar.checkpoint.state import (
    describe_shape,
    entry_kind,
    entry_state_dict,
    flatten,
    is_tensor_leaf,
    load_entry,
    split_leaves,
    to_safe_bytes,
    unflatten,
    validate_state,
)
from manualpar.errors import CheckpointError, CheckpointMismatchError, CollectiveError

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["MANIFEST", "latest_checkpoint", "load_checkpoint", "read_manifest", "save_checkpoint"]

log = logging.getLogger("manualpar.checkpoint")
T = TypeVar("T")


# ---- agreement: a failure on one rank becomes the same error on every rank (never a hang) -----
def _agree(strategy: ManualParallelStrategy, what: str, fn: Callable[[], T]) -> T:
    result: Any = None
    local_error: BaseException | None = None
    try:
        result = fn()
    except (Exception, CheckpointException) as error:
        local_error = error
    if strategy.is_distributed:
        try:
            reports = strategy.all_gather_object(None if local_error is None else str(local_error))
        except CollectiveError as error:  # a peer died or stalled: say what was going on
            raise CollectiveError(f"{what}: {error}") from error
    else:
        reports = [None if local_error is None else str(local_error)]
    failed = [(rank, message) for rank, message in enumerate(reports) if message is not None]
    if not failed:
        return result
    if isinstance(local_error, CheckpointError):
        raise local_error
    rank, message = failed[0]
    raise CheckpointError(f"{what} failed on rank {rank}: {message}") from local_error


def _dcp_call(strategy: ManualParallelStrategy, operation: str, fn: Callable[[], Any]) -> None:
    """Run a DCP call; a dead or stalled peer surfaces as CollectiveError naming the operation."""
    try:
        with strategy.collective_guard(operation), warnings.catch_warnings():
            # Without a process group DCP warns that it assumes one process: that is intended.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            fn()
    except CheckpointException as error:
        raise CheckpointError(f"{operation} failed: {error}") from None


# ---- save ----------------------------------------------------------------------------------
def _state_dicts(state: Mapping[str, Any], *, full: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Flat leaves of the shared entries and of the per-rank entries."""
    shared: dict[str, Any] = {}
    per_rank: dict[str, Any] = {}
    for key, value in state.items():
        target = per_rank if entry_kind(value) == "per_rank" else shared
        target.update(flatten(entry_state_dict(key, value, state, full=full), key))
    return shared, per_rank


def _manifest(strategy: ManualParallelStrategy, state: Mapping[str, Any], kind: str) -> dict:
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
    strategy: ManualParallelStrategy,
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


def _save_sharded(
    strategy: ManualParallelStrategy, path: Path, state: Mapping[str, Any], overwrite: bool
) -> None:
    staging = partial_path(path)
    shared, per_rank = _state_dicts(state, full=False)
    tensors, objects = split_leaves(shared)
    # Global shapes (DTensor and LocalShards report them too): what all ranks write together.
    needed = sum(math.prod(t.shape) * t.element_size() for t in tensors.values())
    _agree(
        strategy,
        f"preparing checkpoint {path}",
        lambda: (
            prepare(path, staging, overwrite, make_dir=True, needed=needed)
            if strategy.is_global_zero
            else None
        ),
    )
    _dcp_call(
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

    _agree(strategy, f"save_checkpoint({path}): writing objects", write_objects)

    def commit() -> None:
        if strategy.is_global_zero:
            manifest = json.dumps(_manifest(strategy, state, "sharded"), indent=2).encode()
            write_file(staging / MANIFEST, manifest)
            swap_in(staging, path)

    _agree(strategy, f"save_checkpoint({path}): commit", commit)


def _save_full(
    strategy: ManualParallelStrategy, path: Path, state: Mapping[str, Any], overwrite: bool
) -> None:
    staging = partial_path(path)
    _agree(
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

    _agree(strategy, f"save_checkpoint({path}, full=True)", write)


# ---- load ----------------------------------------------------------------------------------
def _collapse_values(leaves: Mapping[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """Plain values are replaced whole, so compare them by entry name, not by their leaves."""
    values = {key for key, value in state.items() if entry_kind(value) == "value"}
    return {
        key.split("/")[0] if key.split("/")[0] in values else key: leaf
        for key, leaf in leaves.items()
    }


def _check_match(
    path: Path,
    state: Mapping[str, Any],
    expected: Mapping[str, Any],
    saved: Mapping[str, Any],
    strict: bool,
) -> set[str]:
    """Compare leaves by key and shape; return the keys to load, or raise listing the problems.

    Only the checkpoint's entries named in `state` are compared: loading just the model from a
    training checkpoint that also holds an optimizer is fine.
    """
    saved = {key: leaf for key, leaf in saved.items() if key.split("/")[0] in state}
    original_saved = list(saved)
    expected, saved = _collapse_values(expected, state), _collapse_values(saved, state)
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = sorted(
        f"{key}: checkpoint {saved[key]} vs current {describe_shape(expected[key])}"
        for key in set(expected) & set(saved)
        if is_tensor_leaf(expected[key])
        and isinstance(saved[key], tuple)
        and tuple(expected[key].shape) != saved[key]
    )
    problems = []
    if shapes:
        problems.append(f"shape mismatches: {_clip(shapes)}")
    if strict and missing:
        problems.append(f"missing from the checkpoint: {_clip(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected in the checkpoint: {_clip(unexpected)}")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match the state being loaded; "
            + "; ".join(problems)
            + ". It was probably saved from another model or configuration"
            + ("; strict=False loads only the matching keys." if not shapes else ".")
        )
    values = {key for key, value in state.items() if entry_kind(value) == "value"}
    return {key for key in original_saved if key in expected or key.split("/")[0] in values}


def _clip(items: list[str], limit: int = 20) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _saved_leaves(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensor shapes from DCP metadata, and the replicated non-tensor leaves."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
        objects = torch.load(path / "objects" / "replicated.pt", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"checkpoint {path} is corrupted or truncated: {error}") from None
    shapes = {
        key: tuple(meta.size)
        for key, meta in metadata.state_dict_metadata.items()
        if hasattr(meta, "size")
    }
    return shapes, objects


def _apply(
    strategy: ManualParallelStrategy,
    state: dict[str, Any],
    leaves: Mapping[str, Any],
    per_rank: Mapping[str, Any] | None,
    *,
    full: bool,
    strict: bool,
    path: Path,
) -> None:
    for key, value in list(state.items()):
        kind = entry_kind(value)
        if kind == "per_rank":
            if per_rank is None or not any(k == key or k.startswith(key + "/") for k in per_rank):
                log.warning(
                    "rank %d: %s holds no %r for this rank; keeping the current value",
                    strategy.rank,
                    path,
                    key,
                )
                continue
            loaded = unflatten(per_rank, key)
        else:
            if not any(k == key or k.startswith(key + "/") for k in leaves):
                continue  # absent and not strict: keep the current value
            loaded = unflatten(leaves, key)
        try:
            load_entry(key, value, loaded, state, full=full, strict=strict)
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointMismatchError(
                f"cannot load entry {key!r} ({kind}) from {path}: {error}"
            ) from error


def load_checkpoint(
    strategy: ManualParallelStrategy,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into `state` in place (collective); returns `state`.

    Modules, optimizers and stateful objects are loaded into; plain values are replaced in
    `state`. Any world size can load a sharded checkpoint. Keys and shapes are checked first:
    a mismatch raises CheckpointMismatchError listing them, before anything is modified.
    """
    path = resolve(Path(path).absolute())
    validate_state(state)
    is_full = _agree(strategy, f"opening checkpoint {path}", lambda: _open(path))
    if is_full:
        _load_full(strategy, path, state, strict)
    else:
        _load_sharded(strategy, path, state, strict)
    return state


def _open(path: Path) -> bool:
    if path.is_file() and not path.name.endswith(".partial"):
        return True
    read_manifest(path)
    return False


def _load_sharded(
    strategy: ManualParallelStrategy, path: Path, state: dict[str, Any], strict: bool
) -> None:
    shared, _ = _state_dicts(state, full=False)
    tensors, _objects = split_leaves(shared)
    saved_shapes, saved_objects = _agree(strategy, f"reading {path}", lambda: _saved_leaves(path))
    keep = _agree(
        strategy,
        f"checking {path}",
        lambda: _check_match(path, state, shared, {**saved_shapes, **saved_objects}, strict),
    )
    to_load = {key: tensor for key, tensor in tensors.items() if key in keep}
    _dcp_call(
        strategy,
        f"load_checkpoint({path}): reading tensor shards",
        lambda: dcp.load(
            to_load, storage_reader=dcp.FileSystemReader(path), process_group=strategy.group
        ),
    )
    rank_file = path / "objects" / f"rank_{strategy.rank}.pt"
    per_rank = _agree(
        strategy,
        f"reading {rank_file}",
        lambda: torch.load(rank_file, weights_only=True) if rank_file.exists() else None,
    )
    leaves = {**to_load, **{k: v for k, v in saved_objects.items() if k in keep}}
    _agree(
        strategy,
        f"load_checkpoint({path}): applying",
        lambda: _apply(strategy, state, leaves, per_rank, full=False, strict=strict, path=path),
    )


def _load_full(
    strategy: ManualParallelStrategy, path: Path, state: dict[str, Any], strict: bool
) -> None:
    blob = _agree(strategy, f"reading {path}", lambda: read_full(path))
    shared, _ = _state_dicts(state, full=False)
    per_rank_keys = [k for k, v in state.items() if entry_kind(v) == "per_rank"]
    saved = {
        k: tuple(v.shape) if isinstance(v, torch.Tensor) else v
        for key, value in blob.items()
        if key != FULL_KEY and key not in per_rank_keys
        for k, v in flatten(value, key).items()
    }
    keep = _agree(
        strategy, f"checking {path}", lambda: _check_match(path, state, shared, saved, strict)
    )
    leaves = {
        k: v
        for key, value in blob.items()
        if key != FULL_KEY and key not in per_rank_keys
        for k, v in flatten(value, key).items()
        if k in keep
    }
    mine = f"rank_{strategy.rank}"
    per_rank = {}
    for key in per_rank_keys:
        if isinstance(blob.get(key), dict) and mine in blob[key]:
            per_rank.update(flatten(blob[key][mine], key))
    _agree(
        strategy,
        f"load_checkpoint({path}): applying",
        lambda: _apply(
            strategy, state, leaves, per_rank or None, full=True, strict=strict, path=path
        ),
    )
