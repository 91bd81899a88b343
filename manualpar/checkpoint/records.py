"""What gives a checkpoint's tensors their meaning, recorded beside them and checked on load.

A table's row stands for a raw id only under the table's raw-id setting (hash salt, buckets); a
run's step stands for certain samples only under its global batch. Neither shows in the keys or
shapes a load compares, so a load under another setting succeeded and was silently wrong. An
object that knows such a setting says so with two methods:

    checkpoint_record() -> dict                     # JSON-ready, written into the manifest
    check_checkpoint_record(saved, where) -> None   # raise CheckpointMismatchError naming both

Records come from the state's entries and from the submodules of its modules (named
"model/sparse" for `state["model"].sparse`). An object with a record but no state dict is an
entry of its own kind ("record"): only its record is saved. A load checks every record of the
state against the saved one of the same name before anything is modified; a checkpoint without
it (written before records existed) is accepted as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import nn

__all__ = ["HasCheckpointRecord", "check_records", "records_of", "saved_records"]

MANIFEST_KEY = "records"  # the manifest's {name: record}


@runtime_checkable
class HasCheckpointRecord(Protocol):
    def checkpoint_record(self) -> dict[str, Any]:
        """The settings that give the saved tensors their meaning (JSON-ready)."""
        ...

    def check_checkpoint_record(self, saved: dict[str, Any], where: str) -> None:
        """Raise CheckpointMismatchError if `saved` (a checkpoint's record) gives the tensors
        another meaning than this object's settings; `where` names the checkpoint and entry."""
        ...


def records_of(state: Mapping[str, Any]) -> dict[str, HasCheckpointRecord]:
    """The objects of `state` with a record, by name: an entry's own key, or "key/sub.path"
    for a submodule of a module entry."""
    found: dict[str, HasCheckpointRecord] = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            for path, module in value.named_modules():
                if isinstance(module, HasCheckpointRecord):
                    found[f"{key}/{path}" if path else key] = module
        elif isinstance(value, HasCheckpointRecord):
            found[key] = value
    return found


def saved_records(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The manifest's records of `state`."""
    return {name: obj.checkpoint_record() for name, obj in records_of(state).items()}


def check_records(path: Path, manifest: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Check each record of `state` against the checkpoint's record of the same name; a name
    the checkpoint has no record for (an older checkpoint) is not checked."""
    saved = manifest.get(MANIFEST_KEY) or {}
    for name, obj in records_of(state).items():
        if isinstance(saved.get(name), dict):
            obj.check_checkpoint_record(saved[name], f"checkpoint {path}, {name!r}")
