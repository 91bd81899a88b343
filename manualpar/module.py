"""ParallelModule: an nn.Module whose `setup(strategy)` composes the builders.

The user builds the model (ideally under `empty_init()`), then calls `model.setup(strategy)`, where
each part is handed to a builder (ddp, fsdp, shard_embeddings, ...). Afterwards the model is a
plain nn.Module; `dense_parameters()` lists what a plain torch optimizer should train (parameters
updated by a builder's own fused optimizer are left out).

An optimizer created before setup would hold meta or replaced (pre-sharding) parameters and
silently train nothing: setup refuses one it can find (before any table updates itself in
backward), and a step pre-hook on every torch optimizer catches the rest at their first step.
The same hook warns about an optimizer over `model.parameters()`, which holds the tables'
self-updating parameters: its settings silently do not reach them (not about the optimizer that
updates them, a builder's `updates_own_parameters = True`, e.g. the tables' fused optimizer).
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from manualpar.errors import BuilderError
from manualpar.ownership import owner_of, stale_reason, trained_by_owner

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["ParallelModule", "check_optimizer", "load_trained"]


class ParallelModule(nn.Module):
    """Override `setup(self, strategy)` to wrap your submodules with builders.

    `setup` may run once; afterwards no parameter may remain on the meta device.
    """

    strategy: ManualParallelStrategy | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forward_check = self.register_forward_pre_hook(_check_forward_before_setup)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "setup" in cls.__dict__:
            cls.setup = _checked_setup(cls.__dict__["setup"])  # type: ignore[method-assign]

    def setup(self, strategy: ManualParallelStrategy) -> None:
        """Default: nothing to wrap (every rank holds a full, unsynchronized replica)."""

    @property
    def is_setup(self) -> bool:
        return self.strategy is not None

    def parameters_by_owner(self) -> dict[str | None, list[nn.Parameter]]:
        """Parameters grouped by the builder that owns them (None: no builder)."""
        groups: dict[str | None, list[nn.Parameter]] = {}
        for param in self.parameters():
            groups.setdefault(owner_of(param), []).append(param)
        return groups

    def dense_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters for the dense optimizer: all but those a fused sparse optimizer updates."""
        if not self.is_setup:
            raise BuilderError(
                f"{type(self).__name__}.dense_parameters() called before setup(strategy); "
                "create the optimizer after setup, when parameters are materialized and sharded"
            )
        for module in self.modules():  # a builder's replaced weights take its marks first
            follow = getattr(module, "follow_replaced_weights", None)
            if callable(follow):
                follow()
        return (p for p in self.parameters() if not trained_by_owner(p))


def _checked_setup(user_setup: Callable) -> Callable:
    @functools.wraps(user_setup)
    def setup(self: ParallelModule, strategy: ManualParallelStrategy) -> None:
        if self.strategy is not None:
            raise BuilderError(
                f"{type(self).__name__}.setup() already ran; build a new model to set up again"
            )
        before = list(self.parameters())
        user_setup(self, strategy)
        self.strategy = strategy
        self._forward_check.remove()
        _refuse_optimizers_created_before(self, [p for p in before if stale_reason(p)])
        left = [name for name, p in self.named_parameters() if p.is_meta]
        left += [name for name, b in self.named_buffers() if b.is_meta]
        if left:
            shown = ", ".join(left[:10]) + (
                f" ... and {len(left) - 10} more" if len(left) > 10 else ""
            )
            raise BuilderError(
                f"after {type(self).__name__}.setup() these are still on the meta device: "
                f"{shown}. Wrap them with a builder (ddp/fsdp/shard_embeddings) or call "
                "manualpar.materialize(submodule, strategy) in setup"
            )

    return setup


def _check_forward_before_setup(module: nn.Module, args: Any) -> None:
    """A forward before setup either fails deep in torch (meta tensors) or, under a process
    group, silently trains one unsynchronized replica per rank: say which, and what to do."""
    assert isinstance(module, ParallelModule)
    if module.strategy is not None:
        return
    name = type(module).__name__
    meta = next(
        (n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta), None
    )
    if meta is not None:
        raise BuilderError(
            f"{name}.forward() called before setup(strategy): {meta!r} is still on the meta "
            "device (the model was built under empty_init()); call model.setup(strategy) first"
        )
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and _defines_setup(type(module)) and torch.is_grad_enabled():
        raise BuilderError(
            f"{name}.forward() called before setup(strategy) in a job of {world} ranks: its "
            "parts are not wrapped yet, so each rank would train its own replica; call "
            "model.setup(strategy) first"
        )
    module._forward_check.remove()  # checked once: nothing here can change back


def _defines_setup(cls: type) -> bool:
    """Whether a subclass of ParallelModule defines its own setup() (the default wraps nothing)."""
    return any(
        "setup" in klass.__dict__
        for klass in cls.__mro__
        if klass is not ParallelModule and issubclass(klass, ParallelModule)
    )


# ---- optimizer created before setup -------------------------------------------------------------
_checked_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise BuilderError if `optimizer` holds meta or builder-replaced parameters."""
    for group_index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            why = stale_reason(param)
            if why is not None:
                raise BuilderError(
                    f"{type(optimizer).__name__} holds a parameter of shape "
                    f"{tuple(param.shape)} (param group {group_index}) that {why}{_FIX}"
                )


_FIX = (
    ": the optimizer was created before model.setup(strategy). Create it after setup, e.g. "
    "torch.optim.Adam(model.dense_parameters())"
)


def _refuse_optimizers_created_before(model: nn.Module, stale: list[torch.Tensor]) -> None:
    """At the end of setup, before any forward: an optimizer created earlier holds parameters
    setup replaced. The step pre-hook would catch it too, but only after a backward in which
    sharded tables already updated themselves. torch keeps no registry of optimizers, so their
    param groups are found as the referrers of the replaced tensors (two scans, once), and only
    when something holds one: each scan visits every object of the process (0.2 s of setup in
    one holding torch)."""
    if not stale or not _held_elsewhere(stale):
        return
    wanted = {id(p) for p in stale}
    lists = [
        held
        for held in gc.get_referrers(*stale)
        if isinstance(held, list) and any(id(x) in wanted for x in held)
    ]
    held_ids = {id(held) for held in lists}
    for group in gc.get_referrers(*lists) if lists else []:
        if isinstance(group, dict) and "lr" in group and id(group.get("params")) in held_ids:
            param = next(p for p in group["params"] if id(p) in wanted)
            raise BuilderError(
                f"an optimizer (param group with lr={group['lr']}) holds a parameter of shape "
                f"{tuple(param.shape)} that {stale_reason(param)}{_FIX} (found at the end of "
                f"{type(model).__name__}.setup(), before any update)"
            )


def _held_elsewhere(stale: list[torch.Tensor]) -> bool:
    """Whether anything but setup's two lists of them (`before` and `stale`) holds one of
    `stale`, as an optimizer's param group would. Measured against a control object held by two
    lists the same way, so the interpreter's own references (the loop variable, the call's
    argument) count the same on both sides."""
    control = [object()]
    holders = [control, list(control)]  # two lists hold the control, as two hold each of stale
    expected = _reference_counts(holders[0])[0]
    return any(count > expected for count in _reference_counts(stale))


def _reference_counts(objects: list[Any]) -> list[int]:
    return [sys.getrefcount(obj) for obj in objects]


def _first_step_check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _checked_optimizers:
        return
    check_optimizer(optimizer)
    if not getattr(optimizer, "updates_own_parameters", False):  # a builder's own: holds them
        _warn_if_it_holds_self_trained(optimizer)
    _checked_optimizers.add(optimizer)


def _warn_if_it_holds_self_trained(optimizer: torch.optim.Optimizer) -> None:
    """Warn (once per optimizer: at its first step) if it holds parameters a builder updates
    itself, typically from `model.parameters()` instead of `model.dense_parameters()`. Autograd
    never gives those a gradient, so the optimizer skips them: its weight decay, learning rate
    and param-group settings silently do not apply to them. Only a warning: the training itself
    is right, and an optimizer over them does no harm beyond that."""
    held = [p for group in optimizer.param_groups for p in group["params"] if trained_by_owner(p)]
    if not held:
        return
    builders = sorted({f"{owner_of(p)}()" for p in held})
    shapes = ", ".join(str(tuple(p.shape)) for p in held[:3]) + (" ..." if len(held) > 3 else "")
    warnings.warn(
        f"{type(optimizer).__name__} holds {len(held)} parameter(s) (shapes {shapes}) that "
        f"{' and '.join(builders)} updates itself in backward: they never get a gradient, so this "
        "optimizer's weight decay, learning rate and other param-group settings do not apply "
        "to them. Create the optimizer over model.dense_parameters() instead of "
        "model.parameters()",
        stacklevel=4,  # the caller of optimizer.step() (this, the hook, torch's wrapper)
    )


if os.environ.get("MANUALPAR_NO_OPTIMIZER_CHECK") != "1":
    register_optimizer_step_pre_hook(_first_step_check)


_Model = TypeVar("_Model", bound=ParallelModule)


def load_trained(
    build: Callable[[], _Model],
    strategy: ManualParallelStrategy,
    path: str | os.PathLike,
    *,
    key: str = "model",
    strict: bool = True,
) -> _Model:
    """Build a model on meta, run its setup, then load its weights: one call, any world size.

    `build()` constructs the model (its __init__ only declares modules); `key` is the name the
    model was saved under in `strategy.save_checkpoint(path, {key: model, ...})`. The model
    comes back as the type `build` returns (`load_trained(MyModel, ...)` is a `MyModel` to a
    type checker: no isinstance needed).
    """
    from manualpar.meta import empty_init

    with empty_init():
        model = build()
    model.setup(strategy)
    strategy.load_checkpoint(path, {key: model}, strict=strict)
    return model
