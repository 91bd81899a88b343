"""Build models without allocating them, then allocate and initialize only what this rank keeps.

    strategy.seed_everything(0)          # same seed on every rank -> same initial values
    with empty_init():
        model = Model()                  # every parameter and buffer is on the meta device
    materialize(model.encoder, strategy) # allocate on strategy.device, run reset_parameters()

Initialization replays each submodule's `reset_parameters()` in registration order, so a module
whose `__init__` initializes through `reset_parameters()` (every built-in torch layer) gets exactly
the values eager construction would have given under the same RNG state. Values computed in
`__init__` cannot be recovered from the meta device: a submodule holding meta parameters or
buffers must define `reset_parameters()` or be handled by `init_fn`, else BuilderError.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from manualpar.dtensors import is_dtensor, local_part
from manualpar.errors import BuilderError, ConfigTypeError

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = [
    "empty_init",
    "is_meta",
    "materialize",
    "materialize_placed",
    "require_reset_parameters",
]

Slot = tuple[str, str]  # ("p" or "b", attribute name) of a module's own tensor
# Class attribute of modules a builder shards (its value: the builder's name): materializing
# them whole as part of a larger module on several ranks is refused (see _refuse_whole_copies).
SHARD_FIRST = "sharded_by"

InitFn = Callable[[nn.Module], "bool | None"]
Skip = Callable[[str, nn.Module], bool] | Collection[str]


@contextmanager
def empty_init(enabled: bool = True) -> Iterator[None]:
    """Modules built inside allocate nothing: tensors go to the meta device (shape/dtype only).

    `enabled=False` builds normally, so one code path serves small and huge models.
    """
    with torch.device("meta") if enabled else nullcontext():
        yield


def is_meta(module: nn.Module) -> bool:
    """True if any parameter or buffer of `module` (recursively) is still on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(
    module: nn.Module,
    strategy_or_device: ManualParallelStrategy | torch.device | str,
    *,
    init_fn: InitFn | None = None,
    skip: Skip | None = None,
    seed: int | None = None,
) -> nn.Module:
    """Allocate `module`'s meta tensors on the device and initialize them; return `module`.

    Only meta tensors are touched: parameters already real (materialized earlier, or sharded by
    a builder, e.g. a DTensor whose local shard is real, or owned by another builder) keep their
    storage and values, even when they share a submodule with meta ones.

    Args:
        strategy_or_device: `strategy.device` is used for a strategy, else the given device.
        init_fn: called as `init_fn(submodule)` for submodules with meta tensors but no
            `reset_parameters()`; it must fill their (already allocated) tensors in place and
            return True, else BuilderError.
        skip: submodules to leave on the meta device with their whole subtree (e.g. those
            another rank owns): qualified names relative to `module`, or a predicate
            `skip(name, submodule)`.
        seed: None (default) draws from torch's global RNG in registration order, which matches
            eager construction; call `strategy.seed_everything(seed)` first so every rank draws
            the same values. With an int, each submodule is initialized from its own generator
            state derived from (seed, qualified name): its values then do not depend on which
            other submodules this rank materializes (nor on the world size), and the global
            RNG is left untouched.

    Tied parameters stay tied and are initialized once, by the first submodule owning them.
    """
    device = _target_device(strategy_or_device)
    todo = [
        (name, sub)
        for name, sub in _selected(module, skip)
        if any(t.is_meta for t in _direct(sub).values() if t is not None)
    ]
    if _world_size(strategy_or_device) > 1 and not getattr(module, SHARD_FIRST, None):
        _refuse_whole_copies(todo, _world_size(strategy_or_device))
    if init_fn is None:
        require_reset_parameters(todo, "materialize()", hint_init_fn=True)
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, sub in todo:
        _initialize(name, sub, _allocate(sub, device, memo), init_fn, seed, device)
    return module


def require_reset_parameters(
    modules: Sequence[tuple[str, nn.Module]], who: str, *, hint_init_fn: bool = False
) -> None:
    """Raise BuilderError naming the submodules that hold meta tensors but cannot initialize
    them (no reset_parameters()): the one check every meta-init path makes."""
    missing = [_describe(name, sub) for name, sub in modules if not _has_reset(sub)]
    if missing:
        raise BuilderError(
            f"{who}: these submodules hold meta-device parameters or buffers but define no "
            f"reset_parameters(): {'; '.join(missing)}. Values computed in __init__ cannot be "
            "recovered from the meta device: add a reset_parameters() that initializes the "
            "module's own parameters and buffers in place"
            + (
                ", or pass init_fn=... that does it for them and returns True"
                if hint_init_fn
                else ""
            )
        )


def materialize_placed(
    modules: Sequence[tuple[str, nn.Module]],
    param_device: torch.device,
    buffer_device: torch.device,
    keep: Collection[int],
) -> None:
    """Allocate and initialize meta modules whose parameters a builder already placed (FSDP2's
    sharded DTensors), in place: `to_empty` re-creates each module's own tensors (children
    first, so an FSDP module re-registers its shards after they exist), then each submodule's
    reset_parameters() runs as in `materialize`, on full CPU stand-ins whose local part (this
    rank's shard) is kept, so the values equal eager construction under the same seed on any
    device and world size. Parameters whose id is in `keep` (another builder's) keep their
    values; modules are visited in the given (registration) order."""
    kept = {id(p): p.data for _, m in modules for p in m.parameters(recurse=False) if id(p) in keep}
    for _, module in reversed(modules):
        module.to_empty(device=param_device, recurse=False)
        for key, buffer in module.named_buffers(recurse=False):
            if buffer.device != buffer_device:
                module._buffers[key] = torch.empty_like(buffer, device=buffer_device)
        for param in module.parameters(recurse=False):
            if id(param) in kept:
                param.data = kept[id(param)]  # another builder's tensor: keep its values
    for name, module in modules:  # only modules holding tensors: a parent's reset hits shards
        if _has_reset(module) and (module._parameters or module._buffers):
            fresh = {
                slot
                for slot, t in _direct(module).items()
                if t is not None and not (slot[0] == "p" and id(t) in keep)
            }
            _initialize(name, module, fresh, None, None, buffer_device, full_on_cpu=True)


# ---- helpers -------------------------------------------------------------------------------------
def _world_size(strategy_or_device: Any) -> int:
    return int(getattr(strategy_or_device, "world_size", 1))


def _refuse_whole_copies(todo: Sequence[tuple[str, nn.Module]], world_size: int) -> None:
    """A still-meta module that a builder shards (embedding tables), reached while materializing
    a larger module on several ranks, would be allocated whole on every rank before it is
    sharded: every rank then holds (and initializes) the full tables, silently. Materializing the
    sharded module itself (`materialize(model.emb, strategy)`) says that is meant."""
    whole = [(name, sub) for name, sub in todo if getattr(sub, SHARD_FIRST, None)]
    if not whole:
        return
    size = sum(
        t.numel() * t.element_size()
        for _, sub in whole
        for t in _direct(sub).values()
        if t is not None
    )
    builder = getattr(whole[0][1], SHARD_FIRST)
    names = ", ".join(name or type(sub).__name__ for name, sub in whole)
    raise BuilderError(
        f"materialize(): {names} would be allocated whole on each of the {world_size} ranks "
        f"({size / 2**20:.1f} MiB per rank) before {builder}() shards them; call {builder}() on "
        f"them first and materialize() after (the order in setup), or skip them "
        f"(skip=[...]); to keep whole copies on purpose, materialize that module itself"
    )


def _initialize(
    name: str,
    sub: nn.Module,
    fresh: set[Slot],
    init_fn: InitFn | None,
    seed: int | None,
    device: torch.device,
    *,
    full_on_cpu: bool = False,
) -> None:
    """Run the submodule's initializer on its freshly allocated tensors only."""
    buffers = _poison_buffers(sub, fresh)
    stand_ins = _stand_ins(sub, fresh, full_on_cpu)
    with _seeded(seed, name, device), stand_ins, torch.no_grad():
        if _has_reset(sub):
            sub.reset_parameters()  # type: ignore[operator]
        elif not (init_fn is not None and init_fn(sub)):
            raise BuilderError(
                f"materialize(): init_fn did not handle {_label(name, sub)} (it returned a false "
                "value) and the module has no reset_parameters(); its tensors are allocated but "
                "uninitialized. Make init_fn fill them and return True"
            )
    left = [key for key in buffers if torch.isnan(sub._buffers[key]).any()]  # type: ignore[arg-type]
    if left:
        how = "reset_parameters()" if _has_reset(sub) else "init_fn"
        raise BuilderError(
            f"materialize(): {how} of {_label(name, sub)} left buffers {left} uninitialized "
            "(still NaN): buffers computed in __init__ must be recomputed there too, e.g. "
            "`self.inv_freq.copy_(...)`"
        )


def _target_device(target: Any) -> torch.device:
    if isinstance(target, (str, torch.device)):
        device = torch.device(target)
    elif isinstance(getattr(target, "device", None), torch.device):
        device = target.device
    else:
        raise ConfigTypeError(
            f"materialize(): expected a strategy or a torch.device, got {type(target).__name__}"
        )
    if device.type == "meta":
        raise BuilderError("materialize(): the target device must be a real device, not meta")
    return device


def _selected(root: nn.Module, skip: Skip | None) -> list[tuple[str, nn.Module]]:
    """Submodules in registration order, minus skipped subtrees."""
    modules = list(root.named_modules())
    if skip is None:
        return modules
    if isinstance(skip, str):
        skip = [skip]
    if callable(skip):
        skipped = [name for name, sub in modules if skip(name, sub)]
    else:
        known = {name for name, _ in modules}
        unknown = sorted(set(skip) - known)
        if unknown:
            raise BuilderError(
                f"materialize(): skip names {unknown} are not submodules of "
                f"{type(root).__name__}; known names include {sorted(known)[:10]}"
            )
        skipped = list(skip)

    def inside(name: str) -> bool:
        return any(name == s or not s or name.startswith(s + ".") for s in skipped)

    return [(name, sub) for name, sub in modules if not inside(name)]


def _direct(module: nn.Module) -> dict[Slot, torch.Tensor | None]:
    slots: dict[Slot, torch.Tensor | None] = {}
    slots.update({("p", k): v for k, v in module._parameters.items()})
    slots.update({("b", k): v for k, v in module._buffers.items()})
    return slots


def _has_reset(module: nn.Module) -> bool:
    return callable(getattr(module, "reset_parameters", None))


def _label(name: str, module: nn.Module) -> str:
    return f"'{name or '<root>'}' ({type(module).__name__})"


def _describe(name: str, module: nn.Module) -> str:
    meta = [k for (_, k), t in _direct(module).items() if t is not None and t.is_meta]
    return f"'{name or '<root>'}' ({type(module).__name__}: {', '.join(meta)})"


def _allocate(
    module: nn.Module, device: torch.device, memo: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> set[Slot]:
    """Replace the module's meta tensors by uninitialized real ones; return the slots filled
    here for the first time (a tied tensor another submodule already allocated is not fresh)."""
    fresh: set[Slot] = set()
    for (kind, key), old in _direct(module).items():
        if old is None or not old.is_meta:
            continue
        if id(old) not in memo:
            data = torch.empty_like(old, device=device)
            new = nn.Parameter(data, requires_grad=old.requires_grad) if kind == "p" else data
            new.__dict__.update(old.__dict__)  # keep attributes such as the owning builder
            memo[id(old)] = (old, new)  # holding `old` keeps its id unique during the call
            fresh.add((kind, key))
        slots: dict[str, Any] = module._parameters if kind == "p" else module._buffers
        slots[key] = memo[id(old)][1]
    return fresh


def _poison_buffers(module: nn.Module, fresh: set[Slot]) -> list[str]:
    """Fill fresh floating buffers with NaN, so one the initializer forgot is caught, not used."""
    names = [key for kind, key in fresh if kind == "b" and module._buffers[key].is_floating_point()]  # type: ignore[union-attr]
    for key in names:
        module._buffers[key].fill_(float("nan"))  # type: ignore[union-attr]
    return names


@contextmanager
def _stand_ins(module: nn.Module, fresh: set[Slot], full_on_cpu: bool) -> Iterator[None]:
    """While initializing, give reset_parameters() plain, full tensors to write. A fresh plain
    tensor is written in place (unless `full_on_cpu`: through a CPU copy, so the CPU generator
    draws it); a fresh sharded one (DTensor) through a full CPU copy whose local part is kept;
    any other (already real, or another builder's) through a scratch copy that is thrown away,
    so the RNG advances as in eager construction but nothing real is overwritten."""
    originals = {slot: t for slot, t in _direct(module).items() if t is not None}
    for (kind, key), tensor in originals.items():
        sharded = is_dtensor(tensor)
        if (kind, key) in fresh and not sharded and not full_on_cpu:
            continue
        on_cpu = sharded or ((kind, key) in fresh and full_on_cpu)
        scratch = torch.empty(
            tensor.shape, dtype=tensor.dtype, device="cpu" if on_cpu else tensor.device
        )
        _set_slot(module, kind, key, scratch, tensor.requires_grad)
    try:
        yield
        with torch.no_grad():
            for (kind, key), tensor in originals.items():
                written = _direct(module)[kind, key]
                if (kind, key) in fresh and written is not tensor and written is not None:
                    local = local_part(tensor)
                    local.copy_(_local_slice(written, tensor))
    finally:
        for (kind, key), tensor in originals.items():
            slots: dict[str, Any] = module._parameters if kind == "p" else module._buffers
            slots[key] = tensor


def _set_slot(module: nn.Module, kind: str, key: str, value: torch.Tensor, grad: bool) -> None:
    if kind == "p":
        module._parameters[key] = nn.Parameter(value, requires_grad=grad)
    else:
        module._buffers[key] = value


def _local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` under the placements of the DTensor `param` (FSDP's dim-0
    shards, HSDP's (Replicate, Shard(0)), tensor parallel's row or column shards, and their 2-D
    compositions), cut locally with torch's own chunking (no collective; one full parameter at a
    time visits the mesh's device); the whole tensor for a plain one."""
    if not is_dtensor(param):
        return full
    from torch.distributed.tensor import distribute_tensor

    local = distribute_tensor(
        full, param.device_mesh, param.placements, src_data_rank=None
    ).to_local()
    if tuple(local.shape) != tuple(param.to_local().shape):
        raise BuilderError(
            f"materialize: cannot place the initialized {tuple(full.shape)} parameter: its "
            f"placements {param.placements} give a local shard of {tuple(local.shape)}, but "
            f"the module holds {tuple(param.to_local().shape)}"
        )
    return local


@contextmanager
def _seeded(seed: int | None, name: str, device: torch.device) -> Iterator[None]:
    """With a seed, run the block on RNG state derived from (seed, name), then restore."""
    if seed is None:
        yield
        return
    if device.type not in ("cpu", "cuda"):
        raise BuilderError(f"materialize(seed=...): supported on cpu and cuda, not {device.type}")
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    derived = int.from_bytes(digest, "little") % 2**63
    on_cuda = device.type == "cuda"
    index = (
        (device.index if device.index is not None else torch.cuda.current_device())
        if on_cuda
        else None
    )
    with torch.random.fork_rng(devices=[index] if on_cuda else []):
        torch.random.default_generator.manual_seed(derived)
        if on_cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(derived)
        yield
