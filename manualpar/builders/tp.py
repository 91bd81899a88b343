"""tp(): tensor parallel over one mesh dim with torch's `parallelize_module`.

    mesh = strategy.mesh(dp=2, tp=2)
    mp.tp(self.blocks, strategy, mesh=mesh["tp"], plan={"fc1": "colwise", "fc2": "rowwise"})
    mp.fsdp(self.blocks, strategy, mesh=mesh["dp"])          # optional: 2-D (FSDP x TP)

"colwise" shards an nn.Linear's weight by output features (ColwiseParallel: the input is
replicated over the tp ranks, the output is this rank's slice of features); "rowwise" by input
features (RowwiseParallel: it takes that slice and all-reduces the partial outputs). A colwise
layer followed by a rowwise one (an MLP, attention's qkv and out projections) costs one
all-reduce of the activations per forward and one in backward. A torch ParallelStyle object
(SequenceParallel, PrepareModuleInput, a ColwiseParallel with other layouts, ...) is passed
through as is.

The tp ranks of a mesh row must feed identical inputs (they compute one replica's batch).
Parameters become DTensors on the tp mesh; fsdp() may then shard them over another dim of the
same mesh. Built on meta, `module` is materialized here: each rank allocates its tp slice of the
planned layers (and the rest of `module` whole) and initializes them with the values eager
construction gives under the same seed, so a later fsdp() shards real tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from manualpar.builders.mesh_composition import TP, builder_mesh, mesh_label
from manualpar.errors import BuilderError
from manualpar.meta import materialize_placed, require_reset_parameters
from manualpar.ownership import builder_of, claim, mark_replaced, mesh_of, owner_of
from manualpar.seed import warn_if_seeded_per_rank
from manualpar.strategy import ManualParallelStrategy

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["TpPlan", "tp"]

# "colwise", "rowwise" or a torch ParallelStyle (torch.distributed.tensor.parallel: imported
# only when tp() runs, as it pulls in DTensor, ~0.5 s per process)
TpStyle = Literal["colwise", "rowwise"] | Any
TpPlan = Mapping[str, TpStyle]


def tp(
    module: nn.Module,
    strategy: ManualParallelStrategy,
    *,
    mesh: DeviceMesh,
    plan: TpPlan,
) -> nn.Module:
    """Shard the planned submodules of `module` over the 1-D `mesh`; return `module`.

    `plan` maps submodule paths relative to `module` ("attn.qkv", "mlp.0") to "colwise",
    "rowwise" or a torch ParallelStyle. With no process group (world size 1) nothing is
    sharded: the module is moved to (or materialized on) the strategy's device.
    """
    over = builder_mesh(mesh, strategy, TP, (1,))
    if over is None:
        raise BuilderError(
            "tp(): mesh= is required: the tp dim of a strategy mesh, e.g. "
            "mesh = strategy.mesh(dp=2, tp=2); tp(module, strategy, mesh=mesh['tp'], plan=...)"
        )
    styles = _resolve(module, plan)
    _check_free(module, styles, over, strategy.world_size)
    old = [p for path in styles for p in module.get_submodule(path).parameters()]
    keep = {id(p) for p in module.parameters() if owner_of(p) is not None}
    from_meta = _check_meta(module, keep)
    if not from_meta:
        _move(module, strategy.device)
    if strategy.is_distributed and over.size() > 1:
        mark_replaced(old, TP)
        from torch.distributed.tensor.parallel import parallelize_module

        with strategy.collective_guard(f"tp(): parallelize_module over {mesh_label(over)}"):
            # From real tensors tp rank 0's values are sent to the others (as DDP does); on
            # meta there is nothing to send, each rank initializes its own slice below.
            parallelize_module(module, over, dict(styles), src_data_rank=None if from_meta else 0)
    if from_meta:
        warn_if_seeded_per_rank(f"{TP}()")
        materialize_placed(_free_modules(module), strategy.device, strategy.device, keep=keep)
    new = [
        (f"{path}.{name}", p)
        for path in styles
        for name, p in module.get_submodule(path).named_parameters()
    ]
    claim(module, TP, params=new, mesh=over, take_module=False)
    return module


def _resolve(module: nn.Module, plan: object) -> dict[str, ParallelStyle]:
    """The plan with every path checked and every string turned into its ParallelStyle."""
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    named = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if not isinstance(plan, Mapping) or not plan:
        raise BuilderError(
            f"tp(): plan must be a non-empty dict of submodule path -> 'colwise' | 'rowwise' | "
            f"ParallelStyle, got {plan!r}"
        )
    linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    styles: dict[str, ParallelStyle] = {}
    for path, style in plan.items():
        try:
            sub = module.get_submodule(path) if isinstance(path, str) else None
        except AttributeError:
            sub = None
        if sub is None or sub is module:
            raise BuilderError(
                f"tp(): plan path {path!r} is not a submodule of {type(module).__name__}; paths "
                f"are relative to the module passed to tp() (its nn.Linear layers: "
                f"{', '.join(linears[:8]) or 'none'}{' ...' if len(linears) > 8 else ''})"
            )
        if isinstance(style, ParallelStyle):
            styles[path] = style
            continue
        if style not in named:
            raise BuilderError(
                f"tp(): plan[{path!r}] is {style!r}; use 'colwise', 'rowwise' or a torch "
                "ParallelStyle object (torch.distributed.tensor.parallel)"
            )
        if not isinstance(sub, nn.Linear):
            raise BuilderError(
                f"tp(): plan[{path!r}] = {style!r} needs an nn.Linear, but {path!r} is a "
                f"{type(sub).__name__}; plan the nn.Linear layers inside it (e.g. "
                f"{', '.join(repr(n) for n in linears if n.startswith(path + '.'))[:120] or '...'}"
                "), or pass a torch ParallelStyle object for this module"
            )
        styles[path] = named[style]()
    nested = [(a, b) for a in styles for b in styles if b.startswith(a + ".")]
    if nested:
        raise BuilderError(
            f"tp(): plan paths {nested[0][0]!r} and {nested[0][1]!r} overlap (one holds the "
            "other); plan each layer once"
        )
    return styles


def _check_free(
    module: nn.Module, styles: Mapping[str, ParallelStyle], mesh: DeviceMesh, world_size: int
) -> None:
    """tp comes first: the planned layers must not belong to a builder already."""
    for path in styles:
        sub = module.get_submodule(path)
        for name, param in sub.named_parameters():
            owner = owner_of(param)
            taken_by = builder_of(sub) or owner
            if owner is None and builder_of(sub) is None:
                continue
            where = mesh_label(mesh_of(param), world_size)
            raise BuilderError(
                f"tp(): parameter '{path}.{name}' {tuple(param.shape)} is already owned by "
                f"{taken_by}() on {where}; tp() over {mesh_label(mesh, world_size)} cannot "
                "shard it again. Call tp() first, then fsdp() on another dim of the same mesh"
            )


def _free_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Submodules (registration order) no other builder took over, with their names."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        out.append((name, module))
        for child_name, child in module.named_children():
            if builder_of(child) is None:
                visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", root)
    return out


def _check_meta(root: nn.Module, keep: set[int]) -> bool:
    """True if this call's tensors are all on meta; raise if only some are, or if a submodule
    holding meta tensors cannot initialize them (no reset_parameters)."""
    modules = _free_modules(root)
    tensors = [
        t
        for _, m in modules
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
        if id(t) not in keep
    ]
    on_meta = sum(t.is_meta for t in tensors)
    if on_meta and on_meta < len(tensors):
        raise BuilderError(
            f"tp(): {type(root).__name__} has {on_meta} tensors on the meta device and "
            f"{len(tensors) - on_meta} elsewhere; build it entirely under empty_init() or "
            "entirely on a real device"
        )
    with_meta = [
        (n, m) for n, m in modules if any(t.is_meta for t in m.parameters(recurse=False))
    ] + [(n, m) for n, m in modules if any(t.is_meta for t in m.buffers(recurse=False))]
    require_reset_parameters(with_meta, "tp()")
    return bool(on_meta)


def _move(root: nn.Module, device: torch.device) -> None:
    """Move this call's plain parameters and buffers to the device, in place."""
    for _, module in _free_modules(root):
        for param in module.parameters(recurse=False):
            if owner_of(param) is None and param.device != device:
                param.data = param.data.to(device)
        for key, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                module._buffers[key] = buffer.to(device)
