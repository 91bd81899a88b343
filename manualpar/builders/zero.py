"""Optimizer-state sharding (ZeRO-1) and the gradient scaler for fp16 with sharded parameters.

`zero_optimizer` wraps torch's ZeroRedundancyOptimizer: each rank keeps the optimizer state of
a 1/world_size partition of the parameters, steps only that partition, then broadcasts the
updated parameters. Gradients must already be identical on every rank (DDP, or an all-reduce),
exactly as with a plain optimizer under DDP. Parameters sharded by fsdp() need none of this:
their optimizer state is already sharded.

Checkpointing: strategy.save_checkpoint cannot save a ZeroRedundancyOptimizer directly (its
state lives on several ranks and torch refuses `state_dict()` until it is consolidated). The
torch way works: `optimizer.consolidate_state_dict(to=0)` on every rank, then rank 0 saves
`optimizer.state_dict()` (e.g. with torch.save); to resume, every rank calls
`optimizer.load_state_dict(full_state)` and keeps its own partition (any world size).

`mesh=` (a 1-D DeviceMesh dim) shards the state over that dim's ranks only, e.g. next to
`ddp(..., mesh=mesh["replicate"])`: every rank of a row then holds identical gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from manualpar.builders.mesh_composition import builder_mesh, refuse_tp_params
from manualpar.dtensors import is_dtensor
from manualpar.errors import BuilderError
from manualpar.ownership import stale_reason
from manualpar.strategy import ManualParallelStrategy

__all__ = ["sharded_grad_scaler", "zero_optimizer"]


def zero_optimizer(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    optimizer_class: type[torch.optim.Optimizer],
    strategy: ManualParallelStrategy,
    *,
    mesh: DeviceMesh | None = None,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """An `optimizer_class(params, **kwargs)` whose state is sharded over the strategy's ranks
    (or over the ranks of the 1-D `mesh`).

    With no process group (world size 1) this is the plain optimizer. Create it after
    `model.setup(strategy)`: parameters still on meta, or replaced by a builder, raise
    BuilderError here instead of silently training tensors the model no longer uses.
    """
    over = builder_mesh(mesh, strategy, "zero_optimizer", (1,))
    items, tensors = _normalize(params)
    name = f"zero_optimizer({optimizer_class.__name__})"
    refuse_tp_params(
        ((f"{index}", t) for index, t in enumerate(tensors)),
        "zero_optimizer",
        over,
        strategy.world_size,
    )
    _check_params(tensors, name)
    if not strategy.is_distributed:
        return optimizer_class(items, **kwargs)
    # Imported here: torch.distributed.optim scripts its functional optimizers on import.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    group = strategy.group if over is None else over.get_group()
    return ZeroRedundancyOptimizer(items, optimizer_class, process_group=group, **kwargs)


def _normalize(params: Iterable[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """Parameters or param groups as lists (read once: generators are consumed here)."""
    items: list[Any] = []
    tensors: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            group = item["params"]
            group = [group] if isinstance(group, torch.Tensor) else list(group)
            items.append({**item, "params": group})
            tensors += group
        else:
            items.append(item)
            tensors.append(item)
    return items, tensors


def _check_params(tensors: list[torch.Tensor], name: str) -> None:
    if not tensors:
        raise BuilderError(f"{name}: got no parameters")
    for index, param in enumerate(tensors):
        if not isinstance(param, torch.Tensor):
            raise BuilderError(
                f"{name}: parameter {index} is a {type(param).__name__}, "
                "not a tensor; pass model.parameters() or param groups"
            )
        why = stale_reason(param)
        if why is not None:
            raise BuilderError(
                f"{name}: parameter {index} of shape {tuple(param.shape)} {why}. Create the "
                "optimizer after model.setup(strategy), from the model's current parameters"
            )
        if is_dtensor(param):
            raise BuilderError(
                f"{name}: parameter {index} of shape {tuple(param.shape)} is sharded (a DTensor, "
                "e.g. from fsdp()), so its optimizer state is already sharded; use a plain "
                "torch optimizer for it"
            )


def sharded_grad_scaler(
    strategy: ManualParallelStrategy,
    *,
    sharded: bool = True,
    mesh: DeviceMesh | None = None,
    **kwargs: Any,
) -> torch.amp.GradScaler:
    """Loss scaling for fp16 training on CUDA (kwargs go to the scaler: init_scale, ...).

    With sharded parameters (fsdp, zero) each rank sees only its shard's gradients, so an
    inf/NaN found on one rank must skip the step on all: ShardedGradScaler all-reduces that
    flag over the strategy's group. `sharded=False` (or one process) gives torch.amp.GradScaler,
    enough when every rank holds the full, identical gradients (DDP).
    On CPU this raises: fp16 loss scaling needs CUDA; train in bfloat16 there, which has fp32's
    exponent range and needs no scaler. `mesh=` (1-D) agrees on the flag over that dim only;
    pass the mesh the parameters are sharded over (for HSDP the whole job: leave it None).
    """
    over = builder_mesh(mesh, strategy, "sharded_grad_scaler", (1,))
    if strategy.device.type != "cuda":
        raise BuilderError(
            f"sharded_grad_scaler(): fp16 loss scaling needs CUDA, but this rank runs on "
            f"{strategy.device}. Use bfloat16 instead, which needs no loss scaling: "
            "fsdp(module, strategy, param_dtype=torch.bfloat16) or "
            "torch.autocast('cpu', dtype=torch.bfloat16)"
        )
    if sharded and strategy.is_distributed:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(
            device=strategy.device.type,
            process_group=strategy.group if over is None else over.get_group(),
            **kwargs,
        )
    return torch.amp.GradScaler(strategy.device.type, **kwargs)
