"""fsdp(): shard a module's parameters, gradients and optimizer state with FSDP2 `fully_shard`.

Each rank keeps 1/world_size of every parameter (a DTensor sharded on dim 0); a forward or
backward all-gathers a block's parameters and frees them again, gradients are reduce-scattered.
A plain torch optimizer created after setup then updates only the local shards.

Built on meta: the module is sharded first, then only the local shards are allocated and
initialized. Initialization runs each submodule's `reset_parameters()` on a temporary full CPU
copy of that submodule's own parameters (one submodule at a time) and keeps this rank's slice,
so the result equals eager construction under the same `torch.manual_seed`, for any world size,
mesh (FSDP, HSDP, FSDP over tp's shards) and device (seeded the same on every rank: under
`strategy.seed_everything(..., per_rank=True)` each rank draws from its own stream, and fsdp()
warns). (DTensor random ops are not used: on CPU
they draw every shard from the start of the generator, and on CUDA they follow another RNG, so
neither matches eager init.) Submodules are
initialized in registration order (`module.modules()`, parents before children), which is the
order their `__init__`s ran for the usual containers of leaf layers; only submodules that hold
parameters or buffers themselves are reset (a parent's reset_parameters that re-initializes its
children is not called).

Meshes: `mesh=None` shards over the strategy's whole group; a 1-D mesh (a dim of
`strategy.mesh(...)`) shards over that dim; a 2-D mesh (replicate, shard) is HSDP: parameters are
sharded over the inner dim and replicated over the outer one; gradients are reduce-scattered
inside each shard group, then all-reduced across the replicas (FSDP2 does both). Parameters tp()
sharded can be sharded further over another dim of the same mesh (2-D DTensors).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from manualpar.builders.mesh_composition import (
    TP,
    builder_mesh,
    composes_with_tp,
    mesh_label,
    refuse_taken,
)
from manualpar.errors import BuilderError
from manualpar.meta import materialize_placed, require_reset_parameters
from manualpar.ownership import (
    builder_of,
    claim,
    mark_replaced,
    mesh_of,
    owned_by_others,
    owner_of,
)
from manualpar.seed import warn_if_seeded_per_rank
from manualpar.strategy import ManualParallelStrategy

__all__ = ["fsdp"]

BUILDER = "fsdp"
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # no forward of their own: never wrapped alone


def fsdp(
    module: nn.Module,
    strategy: ManualParallelStrategy,
    *,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    min_num_params: int | None = None,
    wrap: tuple[type[nn.Module], ...] | type[nn.Module] | Sequence[nn.Module] | None = None,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard `module` over the strategy's ranks (FSDP2) and return it (the same object).

    Args:
        reshard_after_forward: free gathered parameters after forward (re-gathered in
            backward): less memory, one more all-gather per block.
        cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU.
        param_dtype, reduce_dtype: mixed precision: compute in `param_dtype`, reduce gradients
            in `reduce_dtype`; the sharded (optimizer) copy stays in the original dtype.
        min_num_params: size-based auto-wrap: bottom-up, every submodule whose not-yet-wrapped
            subtree holds at least this many parameters is sharded as its own block.
        wrap: module classes (each instance is a block) or a list of submodules to shard as
            blocks; blocks gather their parameters one at a time, which bounds peak memory.
        mesh: None (the strategy's whole group), a 1-D mesh (shard over that dim) or a 2-D
            mesh (replicate, shard): HSDP. tp()'d parameters need another dim of tp's mesh.

    Parameters another builder already owns are passed to `fully_shard` as ignored and keep
    their values. With no process group (world size 1) nothing is sharded: the module is moved
    to (or materialized on) `strategy.device` and returned; mixed precision and CPU offload are
    then not applied (a warning says so) - use `torch.autocast` for single-process runs.
    """
    over = builder_mesh(mesh, strategy, BUILDER, (1, 2))
    _check_not_wrapped(module, over, strategy.world_size)
    _check_tp_parts(module, over, strategy.world_size)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # fully_shard needs a forward
        raise BuilderError(
            f"{BUILDER}(): a {type(module).__name__} has no forward to shard around; shard each "
            f"block (for block in blocks: {BUILDER}(block, strategy)), or shard the module "
            f"that holds it with wrap=[...] naming the blocks"
        )
    ignored = _ignored(module)
    from_meta = _check_meta(module, ignored)
    blocks = _blocks(module, wrap, min_num_params, ignored)  # validated on one process too
    if not strategy.is_distributed:
        if param_dtype is not None or reduce_dtype is not None or cpu_offload:
            warnings.warn(
                "fsdp(): no process group (world size 1), so the module is not "
                "sharded and param_dtype/reduce_dtype/cpu_offload are not applied",
                stacklevel=2,
            )
        if from_meta:
            _materialize(module, strategy.device, strategy.device, ignored)
        else:
            _move(module, strategy.device, ignored)
        _claim(module, over)
        return module
    assert strategy.group is not None  # is_distributed
    # imported here: torch.distributed.fsdp (with DTensor) costs every process ~0.5 s to import
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    shard_mesh = over or DeviceMesh.from_group(strategy.group, strategy.device.type)
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=strategy.device.type == "cuda")
        if cpu_offload
        else OffloadPolicy()
    )
    shard = functools.partial(
        fully_shard,
        mesh=shard_mesh,
        reshard_after_forward=reshard_after_forward,
        offload_policy=offload,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        ignored_params=set(ignored.values()) or None,
    )
    mark_replaced([p for p in module.parameters() if owner_of(p) in (None, TP)], BUILDER)
    for block in blocks:
        shard(block)
    shard(module)
    if from_meta:
        param_device = torch.device("cpu") if cpu_offload else strategy.device
        _materialize(module, param_device, strategy.device, ignored)
    _claim(module, over)
    return module


def _check_not_wrapped(module: nn.Module, mesh: DeviceMesh | None, world_size: int) -> None:
    refuse_taken(module, BUILDER, mesh, world_size)
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        raise BuilderError(
            f"fsdp(): module {type(module).__name__} was already set up by fully_shard(); call "
            "fsdp once per module (to shard blocks separately, pass wrap=... or "
            "min_num_params=... to a single call)"
        )
    taken = [
        n
        for n, p in module.named_parameters()  # skips an fsdp()'d child's subtree
        if owner_of(p) == BUILDER and any(p is q for q in _own_params(module))
    ]
    if taken:
        raise BuilderError(
            f"fsdp(): parameters of {type(module).__name__} ({', '.join(taken[:3])}) are already "
            "sharded by an fsdp() call on an enclosing module; shard this part as a block of "
            "that call instead (wrap=[...] or wrap=(BlockClass,))"
        )


def _check_tp_parts(module: nn.Module, mesh: DeviceMesh | None, world_size: int) -> None:
    """tp()'s parameters may be sharded further only over another dim of tp's mesh."""
    for name, param in module.named_parameters():
        if owner_of(param) == TP and not composes_with_tp(mesh_of(param), mesh):
            raise BuilderError(
                f"fsdp(): parameter {name!r} {tuple(param.shape)} is sharded by tp() over "
                f"{mesh_label(mesh_of(param), world_size)}; fsdp() over "
                f"{mesh_label(mesh, world_size)} cannot shard it further. Pass another dim of "
                "the same mesh, e.g. mesh = strategy.mesh(dp=2, tp=2); tp(..., mesh=mesh['tp']); "
                "fsdp(..., mesh=mesh['dp'])"
            )


def _claim(module: nn.Module, mesh: DeviceMesh | None) -> None:
    claim(
        module,
        BUILDER,
        params=[(n, p) for n, p in module.named_parameters() if owner_of(p) in (None, TP)],
        mesh=mesh,
    )


# ---- which submodules are this call's, and which become their own FSDP block -------------
def _own_params(root: nn.Module) -> list[nn.Parameter]:
    return [p for m in _own_modules(root) for p in m.parameters(recurse=False)]


def _ignored(root: nn.Module) -> dict[int, nn.Parameter]:
    """Parameters other builders own, plus any inside a subtree another builder took over
    (except an earlier fsdp call's: fully_shard already skips FSDP submodules)."""
    ignored = {id(p): p for _, p in owned_by_others(root, BUILDER) if owner_of(p) != TP}
    own = {id(p) for p in _own_params(root)}
    for param in root.parameters():
        if id(param) not in own and owner_of(param) is None:
            ignored[id(param)] = param
    return ignored


def _own_modules(root: nn.Module) -> Iterator[nn.Module]:
    """Pre-order, skipping subtrees another builder (or an earlier fsdp call) took over."""
    seen: set[int] = set()

    def visit(module: nn.Module) -> Iterator[nn.Module]:
        if id(module) in seen:
            return
        seen.add(id(module))
        yield module
        for child in module.children():
            if builder_of(child) is None:
                yield from visit(child)

    yield from visit(root)


def _blocks(
    root: nn.Module, wrap: object, min_num_params: int | None, ignored: dict[int, nn.Parameter]
) -> list[nn.Module]:
    """Submodules to fully_shard before the root, children before parents."""
    own = list(_own_modules(root))
    explicit: set[int] = set()
    if isinstance(wrap, type) or (
        isinstance(wrap, tuple) and wrap and all(isinstance(w, type) for w in wrap)
    ):
        explicit = {id(m) for m in own[1:] if isinstance(m, wrap)}
    elif wrap is not None:
        listed = list(wrap)  # type: ignore[call-overload]
        own_ids = {id(m) for m in own}
        for index, sub in enumerate(listed):
            if not isinstance(sub, nn.Module) or sub is root or id(sub) not in own_ids:
                raise BuilderError(
                    f"fsdp(wrap=...): item {index} ({type(sub).__name__}) is not a submodule of "
                    f"{type(root).__name__} that this call shards (not the root itself, nor a "
                    "part another builder owns); pass module classes or submodules"
                )
        explicit = {id(m) for m in listed}
    if min_num_params is not None and min_num_params <= 0:
        raise BuilderError(f"fsdp(): min_num_params must be positive, got {min_num_params}")
    chosen = {m for m in own[1:] if id(m) in explicit}
    if min_num_params is not None:
        _auto_wrap(root, min_num_params, explicit, ignored, chosen)
    # Reversed pre-order puts every descendant before its ancestors, as fully_shard requires.
    return [m for m in reversed(own) if m in chosen]


def _auto_wrap(
    root: nn.Module,
    min_num_params: int,
    explicit: set[int],
    ignored: dict[int, nn.Parameter],
    chosen: set[nn.Module],
) -> None:
    """fairscale's default_auto_wrap_policy: wrap bottom-up once a subtree is big enough."""
    seen: set[int] = set()

    def unwrapped_count(module: nn.Module) -> int:
        if id(module) in seen:
            return 0
        seen.add(id(module))
        count = sum(p.numel() for p in module.parameters(recurse=False) if id(p) not in ignored)
        for child in module.children():
            if builder_of(child) is None:
                count += unwrapped_count(child)
        if module is root:
            return count
        if id(module) in explicit or (
            count >= min_num_params and not isinstance(module, _CONTAINERS)
        ):
            chosen.add(module)
            return 0
        return count

    unwrapped_count(root)


# ---- meta-device modules: allocate and initialize only what this rank keeps ---------------
def _check_meta(root: nn.Module, ignored: dict[int, nn.Parameter]) -> bool:
    """True if this call's parameters are all on meta; raise if only some are, or if a
    submodule holding meta tensors cannot initialize them (no reset_parameters)."""
    on_meta, real = 0, 0
    with_meta: list[tuple[str, nn.Module]] = []
    names = {id(m): name or type(root).__name__ for name, m in root.named_modules()}
    for module in _own_modules(root):
        direct = [p for p in module.parameters(recurse=False) if id(p) not in ignored]
        tensors = direct + list(module.buffers(recurse=False))
        meta_here = sum(t.is_meta for t in tensors)
        on_meta, real = on_meta + meta_here, real + len(tensors) - meta_here
        if meta_here:
            with_meta.append((names.get(id(module), "?"), module))
    if on_meta and real:
        raise BuilderError(
            f"fsdp(): {type(root).__name__} has {on_meta} tensors on the meta device and "
            f"{real} elsewhere; build it entirely under empty_init() or entirely on a "
            "real device"
        )
    require_reset_parameters(with_meta, "fsdp()")
    return bool(on_meta)


def _materialize(
    root: nn.Module,
    param_device: torch.device,
    buffer_device: torch.device,
    ignored: dict[int, nn.Parameter],
) -> None:
    warn_if_seeded_per_rank(f"{BUILDER}()", stacklevel=3)  # fsdp() called us
    names = {id(m): name for name, m in root.named_modules()}
    own = [(names.get(id(m), ""), m) for m in _own_modules(root)]
    materialize_placed(own, param_device, buffer_device, keep=set(ignored))


def _move(root: nn.Module, device: torch.device, ignored: dict[int, nn.Parameter]) -> None:
    """Single process: move this call's parameters and buffers to the device, in place."""
    for module in _own_modules(root):
        for param in module.parameters(recurse=False):
            if id(param) not in ignored and param.device != device:
                param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                module._buffers[name] = buffer.to(device)
