"""Loading a checkpoint into modules, optimizers and stateful objects, on any world size.

Records (what gives the tensors their meaning, checkpoint/records.py), keys and shapes are
compared with the checkpoint first, on every rank, so a mismatch raises CheckpointMismatchError
listing them before anything is modified. A sharded checkpoint is read
by torch.distributed.checkpoint into this rank's shards (resharding as needed); a full export is
memory-mapped and each rank takes its part.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from manualpar.checkpoint.agreement import Ranks, agree, dcp_call
from manualpar.checkpoint.dtypes import (
    check_range,
    copy_back,
    log_conversions,
    narrowing,
    read_copies,
    saved_dtypes,
)
from manualpar.checkpoint.files import FULL_KEY, read_full, read_manifest, resolve
from manualpar.checkpoint.local_shards import loading
from manualpar.checkpoint.records import check_records
from manualpar.checkpoint.save import state_dicts
from manualpar.checkpoint.state import (
    describe_shape,
    entry_kind,
    flatten,
    is_tensor_leaf,
    load_entry,
    split_leaves,
    unflatten,
    validate_state,
)
from manualpar.checkpoint.verify import check_object_file, check_tensor_files, check_tensor_sizes
from manualpar.errors import CheckpointError, CheckpointMismatchError, ConfigError

__all__ = ["load_checkpoint"]

# what a load checks before its first copy (docs/checkpoints.md): every byte, or the sizes only
_VERIFY_CHOICES = ("crc", "sizes")

log = logging.getLogger("manualpar.checkpoint")


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


def _saved_leaves(
    path: Path,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, torch.dtype], Any]:
    """Tensor shapes from DCP metadata, the replicated non-tensor leaves, tensor dtypes, and
    the metadata itself."""
    import torch.distributed.checkpoint as dcp

    check_object_file(path / "objects" / "replicated.pt")
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
    return shapes, objects, saved_dtypes(metadata), metadata


def _check_files(strategy: Ranks, path: Path, metadata: Any, keys: set[str], verify: str) -> Any:
    """Check every file this load reads (checkpoint/verify.py) and read this rank's object
    file, so a bad file stops the load before anything is modified; returns the per-rank
    leaves (None if this rank has none)."""
    if verify == "crc":
        check_tensor_files(path, metadata, keys, strategy.rank, strategy.world_size)
    else:
        check_tensor_sizes(path, metadata, keys)
    rank_file = path / "objects" / f"rank_{strategy.rank}.pt"
    if not rank_file.exists():
        return None
    check_object_file(rank_file)
    return torch.load(rank_file, weights_only=True)


def _apply(
    strategy: Ranks,
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


@loading()  # the state dicts are loaded into: a disk table hands its file over as it is
def load_checkpoint(
    strategy: Ranks,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    strict: bool = True,
    saturate: bool = False,
    verify: str = "crc",
) -> dict[str, Any]:
    """Load a checkpoint into `state` in place (collective); returns `state`.

    Modules, optimizers and stateful objects are loaded into; plain values are replaced in
    `state`. Any world size can load a sharded checkpoint. Keys and shapes are checked first:
    a mismatch raises CheckpointMismatchError listing them, before anything is modified.
    Values that a narrower dtype cannot hold (float32 1e5 into float16) raise CheckpointError,
    also before anything is modified; `saturate=True` clamps them to its largest finite value.
    A missing, truncated or corrupted file raises CheckpointError naming it, also before
    anything is modified: every file is checked first (checkpoint/verify.py).
    `verify="sizes"` checks the tensor files' sizes only, not their CRC-32s: a load as fast as
    a plain DCP one, but a changed byte in a tensor file is loaded as it is.
    """
    given = Path(path).absolute()
    path = resolve(given)
    validate_state(state)
    _check_verify(verify)
    rank = strategy.rank
    shared, _ = state_dicts(state, full=False)

    def open_and_check() -> tuple[dict[str, Any], Any, set[str], dict[str, torch.dtype]] | None:
        """None for a full export; for a sharded checkpoint, its object leaves, this rank's
        per-rank leaves, the keys to load and those read into a narrower dtype, once every
        file is checked (one agreement for all: each is a collective, a measurable part of a
        fast load)."""
        if _open(path, state):
            return None
        saved_shapes, saved_objects, dtypes, metadata = _saved_leaves(path)
        saved = {**saved_shapes, **saved_objects}
        keep = _check_match(path, state, shared, saved, strict)
        per_rank = _check_files(strategy, path, metadata, keep, verify)
        kept = {k: v for k, v in shared.items() if k in keep}
        log_conversions(path, kept, dtypes, rank)
        return saved_objects, per_rank, keep, narrowing(kept, dtypes)

    checked = agree(
        strategy, f"opening checkpoint {path}", open_and_check, same_path=("load_checkpoint", given)
    )
    if checked is None:
        _load_full(strategy, path, state, strict, saturate)
    else:
        _load_sharded(strategy, path, state, shared, strict, saturate, *checked)
    return state


def _check_verify(verify: str) -> None:
    if verify not in _VERIFY_CHOICES:
        raise ConfigError(
            f"load_checkpoint(verify={verify!r}): pass one of {', '.join(_VERIFY_CHOICES)} "
            "('crc', the default, checks every byte of the tensor files before the load; "
            "'sizes' checks only that they hold every byte range); nothing was loaded"
        )


def _open(path: Path, state: Mapping[str, Any]) -> bool:
    """True for a full export; a sharded checkpoint's records are checked here."""
    if path.is_file() and not path.name.endswith(".partial"):
        return True
    check_records(path, read_manifest(path), state)
    return False


def _load_sharded(
    strategy: Ranks,
    path: Path,
    state: dict[str, Any],
    shared: dict[str, Any],
    strict: bool,
    saturate: bool,
    saved_objects: dict[str, Any],
    per_rank: Any,
    keep: set[str],
    narrowed: dict[str, torch.dtype],
) -> None:
    tensors, _objects = split_leaves(shared)
    to_load = {key: tensor for key, tensor in tensors.items() if key in keep}
    copies = read_copies(to_load, narrowed)
    if copies:  # read in the saved dtype and checked first, so a refusal modifies nothing
        _read(strategy, path, copies, "reading tensor shards to check their range")
        targets = {key: to_load[key].dtype for key in copies}
        agree(
            strategy,
            f"load_checkpoint({path}): checking value ranges",
            lambda: check_range(path, copies, targets, strategy.rank, saturate=saturate),
        )
    try:  # the first copy into the live state: every file was checked before it
        _read(
            strategy,
            path,
            {k: v for k, v in to_load.items() if k not in copies},
            "reading tensor shards",
        )
    except CheckpointError as error:
        raise CheckpointError(
            f"{error}. The files passed the check before this read, so one changed or could "
            "not be read during it: the state may be partly loaded; load a checkpoint again "
            "before training"
        ) from error
    copy_back(copies, to_load)
    leaves = {**to_load, **{k: v for k, v in saved_objects.items() if k in keep}}

    def apply() -> None:
        _apply(strategy, state, leaves, per_rank, full=False, strict=strict, path=path)

    agree(strategy, f"load_checkpoint({path}): applying", apply)


def _read(strategy: Ranks, path: Path, tensors: dict[str, Any], what: str) -> None:
    import torch.distributed.checkpoint as dcp

    from manualpar.checkpoint.reader import NamingReader  # with DCP: imported when loading

    dcp_call(
        strategy,
        f"load_checkpoint({path}): {what}",
        lambda: dcp.load(tensors, storage_reader=NamingReader(path), process_group=strategy.group),
    )


def _load_full(
    strategy: Ranks, path: Path, state: dict[str, Any], strict: bool, saturate: bool
) -> None:
    blob = agree(strategy, f"reading {path}", lambda: read_full(path))
    shared, _ = state_dicts(state, full=False)
    per_rank_keys = [k for k, v in state.items() if entry_kind(v) == "per_rank"]
    saved = {
        k: tuple(v.shape) if isinstance(v, torch.Tensor) else v
        for key, value in blob.items()
        if key != FULL_KEY and key not in per_rank_keys
        for k, v in flatten(value, key).items()
    }

    def check() -> dict[str, Any]:
        """The leaves to load, once records, keys, shapes and value ranges are checked."""
        check_records(path, blob.get(FULL_KEY) or {}, state)
        keep = _check_match(path, state, shared, saved, strict)
        check_object_file(path)  # every byte, before the first copy
        leaves = {
            k: v
            for key, value in blob.items()
            if key != FULL_KEY and key not in per_rank_keys
            for k, v in flatten(value, key).items()
            if k in keep
        }
        dtypes = {k: v.dtype for k, v in leaves.items() if isinstance(v, torch.Tensor)}
        kept = {k: v for k, v in shared.items() if k in keep}
        log_conversions(path, kept, dtypes, strategy.rank)
        narrowed = narrowing(kept, dtypes)
        copies = {k: leaves[k].clone() if saturate else leaves[k] for k in narrowed}
        targets = {k: kept[k].dtype for k in narrowed}
        check_range(path, copies, targets, strategy.rank, saturate=saturate)
        return {**leaves, **copies}

    leaves = agree(strategy, f"checking {path}", check)
    mine = f"rank_{strategy.rank}"
    per_rank = {}
    for key in per_rank_keys:
        if isinstance(blob.get(key), dict) and mine in blob[key]:
            per_rank.update(flatten(blob[key][mine], key))
    agree(
        strategy,
        f"load_checkpoint({path}): applying",
        lambda: _apply(
            strategy, state, leaves, per_rank or None, full=True, strict=strict, path=path
        ),
    )
