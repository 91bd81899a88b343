"""Turn a checkpoint `state` mapping into flat state dicts and back.

A `state` maps names to nn.Modules, optimizers, stateful objects (state_dict/load_state_dict),
per-rank objects (`per_rank = True`, e.g. RNGState) and plain values. Saving flattens every entry
into "name/sub/key" leaves: tensors go to torch.distributed.checkpoint (sharded, reshardable), all
other leaves to small weights-only files. torch's get/set_(model|optimizer)_state_dict do the
DDP/FSDP2/DTensor bookkeeping, so builders plug in without changing callers.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

from manualpar.checkpoint.local_shards import full_tensors
from manualpar.checkpoint.records import HasCheckpointRecord
from manualpar.errors import CheckpointError

SEP = "/"


def entry_kind(value: Any) -> str:
    """An optimizer with `saves_own_state = True` (a fused optimizer, whose state dict already
    holds its sharded tables' blocks) is saved as a stateful object, not by parameter. An
    object with a checkpoint record and no state dict is a "record": it holds no leaves."""
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer) and not getattr(value, "saves_own_state", False):
        return "optimizer"
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return "per_rank" if getattr(value, "per_rank", False) else "stateful"
    if isinstance(value, HasCheckpointRecord):  # only its record is saved (checkpoint/records.py)
        return "record"
    return "value"


def validate_state(state: Mapping[str, Any]) -> None:
    for key, value in state.items():
        if not isinstance(key, str) or not key or SEP in key or "." in key:
            raise CheckpointError(
                f"checkpoint state key {key!r} must be a non-empty string without '/' or '.'"
            )
        if entry_kind(value) == "optimizer":
            _check_optimizer_covered(key, value, state)


def modules_root(state: Mapping[str, Any]) -> nn.ModuleDict:
    """All modules of the state under one root, so optimizer FQNs read 'model/fc.weight'."""
    return nn.ModuleDict({k: v for k, v in state.items() if entry_kind(v) == "module"})


def _check_optimizer_covered(key: str, optimizer: torch.optim.Optimizer, state: Mapping) -> None:
    owned = {id(p) for m in modules_root(state).values() for p in m.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in owned:
                raise CheckpointError(
                    f"optimizer {key!r} holds a parameter of shape {tuple(param.shape)} that "
                    "belongs to no module in the checkpoint state; add the module that owns it "
                    "(e.g. state={'model': model, 'optim': optimizer}), and create the optimizer "
                    "after setup()"
                )


def entry_state_dict(key: str, value: Any, state: Mapping[str, Any], *, full: bool) -> Any:
    """The state dict of one entry; with `full`, unsharded and on CPU (collective for FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if full:  # sharded embedding tables return gathered tensors inside this context
        with full_tensors():
            return _entry_state_dict(
                value, state, StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
    return _entry_state_dict(value, state, StateDictOptions())


def _entry_state_dict(value: Any, state: Mapping[str, Any], options: StateDictOptions) -> Any:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    kind = entry_kind(value)
    if kind == "module":
        return get_model_state_dict(value, options=options)
    if kind == "optimizer":
        return get_optimizer_state_dict(modules_root(state), value, options=options)
    if kind in ("stateful", "per_rank"):
        return value.state_dict()
    return value


def load_entry(
    key: str, value: Any, loaded: Any, state: dict[str, Any], *, full: bool, strict: bool
) -> None:
    """Apply a loaded state dict to the entry (plain values are replaced in `state`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=full, strict=strict)
    kind = entry_kind(value)
    if kind == "module":
        set_model_state_dict(value, loaded, options=options)
    elif kind == "optimizer":
        set_optimizer_state_dict(modules_root(state), value, loaded, options=options)
    elif kind in ("stateful", "per_rank"):
        value.load_state_dict(loaded)
    else:
        state[key] = loaded


def flatten(tree: Any, prefix: str) -> dict[str, Any]:
    """{"a": {"b": t}} -> {"prefix/a/b": t}. Only non-empty dicts with str keys are descended."""
    if isinstance(tree, Mapping) and tree and all(isinstance(k, str) for k in tree):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{SEP}{key}"))
        return flat
    return {prefix: tree}


def unflatten(flat: Mapping[str, Any], prefix: str) -> Any:
    """Inverse of flatten for the leaves under `prefix`."""
    if prefix in flat:
        return flat[prefix]
    root: dict[str, Any] = {}
    start = prefix + SEP
    for key, value in flat.items():
        if not key.startswith(start):
            continue
        parts = key[len(start) :].split(SEP)
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return root


def split_leaves(flat: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors (for DCP) and everything else (for the weights-only object files)."""
    tensors = {k: v for k, v in flat.items() if is_tensor_leaf(v)}
    objects = {k: v for k, v in flat.items() if not is_tensor_leaf(v)}
    return tensors, objects


def to_safe_bytes(obj: Any, what: str) -> bytes:
    """torch.save `obj`, proving it loads back with weights_only=True (no unpickling on load)."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as error:
        reason = next(
            (line.strip() for line in str(error).splitlines() if "Unsupported global" in line),
            str(error).splitlines()[0],
        )
        raise CheckpointError(
            f"{what} holds a value that cannot be loaded back safely with "
            f"torch.load(weights_only=True) ({reason}). Store plain types (dict, list, tuple, str, "
            "numbers, tensors) or give the object state_dict()/load_state_dict()."
        ) from None
    return buffer.getvalue()


def is_tensor_leaf(value: Any) -> bool:
    """A tensor, or a sharded value DCP can checkpoint (DTensor-like protocol, LocalShards)."""
    return isinstance(value, torch.Tensor) or hasattr(value, "__create_chunk_list__")


def describe_shape(value: Any) -> str:
    return str(tuple(value.shape)) if is_tensor_leaf(value) else type(value).__name__
