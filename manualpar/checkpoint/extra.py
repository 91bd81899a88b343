"""Extra checkpoint entries a module asks for: state that lives beside its parameters.

A fused optimizer's state, for example, is not a parameter and no torch optimizer holds it, yet
a checkpoint of the model without it resumes wrongly. A module exposes such state by defining
`checkpoint_entries() -> {name: stateful}`; `extra_checkpoint_entries(model)` collects them from
every submodule, so the Trainer saves and restores them without knowing which feature made them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn

__all__ = ["HasCheckpointEntries", "extra_checkpoint_entries"]


@runtime_checkable
class HasCheckpointEntries(Protocol):
    def checkpoint_entries(self) -> dict[str, Any]:
        """Stateful objects (state_dict/load_state_dict) to save beside the module, by name."""
        ...


def extra_checkpoint_entries(model: nn.Module) -> dict[str, Any]:
    """Every submodule's `checkpoint_entries()`, as checkpoint state entries.

    A name used by one module only is kept as is ("sparse_optim"); a name several modules use
    gets each module's path appended ("sparse_optim_user_tower_tables").
    """
    found: list[tuple[str, str, Any]] = [
        (path, key, value)
        for path, module in model.named_modules()
        if isinstance(module, HasCheckpointEntries)
        for key, value in module.checkpoint_entries().items()
    ]
    names = [key for _, key, _ in found]
    entries: dict[str, Any] = {}
    for path, key, value in found:
        name = key if names.count(key) == 1 else f"{key}_{path.replace('.', '_')}"
        entries[name] = value
    return entries
