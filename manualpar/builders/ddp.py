"""ddp(): torch's DistributedDataParallel over the parameters no other builder owns.

    self.bottom = ddp(self.bottom, strategy)                                # mean over ranks
    self.top = ddp(self.top, strategy, normalize_by="global_samples")      # mean over samples

`normalize_by="world_size"` is plain DDP (gradients averaged over ranks; no extra cost). With
`"global_samples"` ranks may hold different batch sizes (Lightning #11922): each rank's loss is the
mean over its own batch as usual, and the synchronized gradient is that of the mean over the whole
global batch, sum_r(n_r * grad_r) / sum_r(n_r). It costs one extra tiny all-reduce (this rank's
sample count) per synchronizing forward; a comm hook then scales each bucket by n_r / N before a
sum all-reduce.

n_r is the first dimension of the first tensor input, unless `set_batch_size(n)` was called before
the forward (it applies to that one forward). Gradient accumulation with `no_sync()` is supported:
samples of the accumulated forwards are added up, and the rank's accumulated gradient is taken as
the gradient of the mean over all of them (equal micro-batches with the loss divided by their
number, as with plain DDP). DDP's `join()` for uneven inputs is not supported in this mode: a rank
without data forwards an empty batch instead (its gradient then counts with weight 0).

`mesh=` (a 1-D DeviceMesh, e.g. `strategy.mesh(replicate=2, shard=2)["replicate"]`) runs DDP over
that dim's ranks only: gradients are averaged (or sample-weighted) inside each row of the dim, and
the sample count of "global_samples" is counted over the same ranks.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from manualpar.builders.mesh_composition import builder_mesh, refuse_taken, refuse_tp_params
from manualpar.errors import BuilderError
from manualpar.ownership import claim, claimed_submodules, owner_of

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["GlobalSamplesDDP", "NormalizeBy", "ddp", "infer_batch_size", "set_batch_size"]

NormalizeBy = Literal["world_size", "global_samples"]
_NORMALIZE_MARK = "_manualpar_ddp_normalize_by"


def ddp(
    module: nn.Module,
    strategy: ManualParallelStrategy,
    *,
    normalize_by: NormalizeBy = "world_size",
    mesh: DeviceMesh | None = None,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Wrap `module` in DistributedDataParallel on the strategy's group (or the 1-D `mesh`'s
    ranks) and device.

    Parameters other builders own (and buffers of submodules they took) are left out of DDP. With
    world size 1 the module is returned unwrapped (there is no process group), but still claimed.
    Extra keyword arguments go to DistributedDataParallel (bucket_cap_mb, static_graph, ...).
    """
    if normalize_by not in ("world_size", "global_samples"):
        raise BuilderError(
            f"ddp(): normalize_by must be 'world_size' or 'global_samples', got {normalize_by!r}"
        )
    if isinstance(module, DistributedDataParallel):
        raise BuilderError(
            f"ddp(): the module is already a DistributedDataParallel (around "
            f"{type(module.module).__name__}); call ddp() once per module"
        )
    over = builder_mesh(mesh, strategy, "ddp", (1,))
    refuse_taken(module, "ddp", over, strategy.world_size)
    if "process_group" in ddp_kwargs:
        raise BuilderError(
            "ddp(): process_group comes from the strategy (or mesh=); do not pass it"
        )
    refuse_tp_params(
        module.named_parameters(remove_duplicate=False), "ddp", over, strategy.world_size
    )
    taken, ignored = _split(module)
    left_on_meta = [n for n, p in taken if p.is_meta] + [
        n for n, b in module.named_buffers() if b.is_meta and n not in ignored
    ]
    if left_on_meta:
        raise BuilderError(
            f"ddp(): {type(module).__name__} still has tensors on the meta device "
            f"({', '.join(left_on_meta[:5])}{' ...' if len(left_on_meta) > 5 else ''}); "
            "call manualpar.meta.materialize on it first (or build it outside empty_init())"
        )
    if not any(p.requires_grad for _, p in taken):
        owners = sorted({str(owner_of(p)) for _, p in module.named_parameters()} - {"None"})
        raise BuilderError(
            f"ddp(): {type(module).__name__} has no trainable parameter left for DDP (owned by "
            f"other builders: {', '.join(owners) or 'none'}; frozen: {len(taken)}); do not wrap it"
        )
    if strategy.world_size > 1 and not strategy.is_distributed:
        raise BuilderError(
            f"ddp(): the strategy has world size {strategy.world_size} but no process group "
            "(was teardown() called?); wrapping now would train each rank alone"
        )
    _move(module, strategy.device, taken)
    wrong = sorted({str(p.device) for _, p in taken} - {str(strategy.device)})
    if wrong and "device_ids" not in ddp_kwargs:
        raise BuilderError(
            f"ddp(): parameters of {type(module).__name__} are on {', '.join(wrong)} but this "
            f"rank's device is {strategy.device}; move them there first, or pass device_ids= "
            "for a module that spans devices"
        )
    claim(module, "ddp", params=taken, mesh=over)  # nothing below refuses the module
    object.__setattr__(module, _NORMALIZE_MARK, normalize_by)
    if not strategy.is_distributed:
        return module
    if ignored:
        earlier = getattr(module, "_ddp_params_and_buffers_to_ignore", ())
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, sorted(set(earlier) | ignored)
        )
    if strategy.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [strategy.device.index])
    if normalize_by == "global_samples":
        return GlobalSamplesDDP(module, strategy, mesh=over, **ddp_kwargs)
    group = strategy.group if over is None else over.get_group()
    return DistributedDataParallel(module, process_group=group, **ddp_kwargs)


def _split(module: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], set[str]]:
    """(parameters DDP takes, names DDP must ignore: other owners' params, their modules' buffers).

    Every name of a shared parameter is listed, since DDP matches module-by-module names.
    """
    foreign = claimed_submodules(module)
    taken: list[tuple[str, nn.Parameter]] = []
    ignored: set[str] = set()
    seen: set[int] = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if owner_of(param) is not None:
            ignored.add(name)
        elif id(param) not in seen:
            seen.add(id(param))
            taken.append((name, param))
    for name, _ in module.named_buffers(remove_duplicate=False):
        if name.startswith(tuple(foreign)):
            ignored.add(name)
    return taken, ignored


def _move(module: nn.Module, device: torch.device, taken: list[tuple[str, nn.Parameter]]) -> None:
    """Move what DDP takes from the CPU to `device`; submodules of other builders stay put."""
    if device.type == "cpu" or any(p.device.type != "cpu" for _, p in taken):
        return
    foreign = claimed_submodules(module)
    for name, sub in module.named_modules():
        if not (name + ".").startswith(tuple(foreign)):
            sub._apply(lambda t: t.to(device), recurse=False)


@dataclass
class _SampleCount:
    """Per-step sample counts shared by a GlobalSamplesDDP forward and its comm hook."""

    strategy: ManualParallelStrategy
    mesh: DeviceMesh | None = None  # the ranks samples are counted over (None: all)
    explicit: int | None = None  # from set_batch_size, for the next forward only
    pending: int = 0  # samples of no_sync forwards since the last synchronizing one
    local: int = 0  # this rank's samples in the step being synchronized
    scale: torch.Tensor | None = None  # local / global, on the device (no host sync)

    def record(self, inputs: tuple, kwargs: dict, sync: bool) -> None:
        n = self.explicit if self.explicit is not None else infer_batch_size(inputs, kwargs)
        self.explicit = None
        self.pending += n
        if not sync:
            return
        self.local, self.pending = self.pending, 0
        count = torch.tensor(self.local, dtype=torch.int64, device=self.strategy.device)
        total = self.strategy.all_reduce(count, op="sum", group=self.mesh)  # one tiny collective
        self.scale = self.local / total.clamp(min=1)


def _global_samples_hook(
    state: _SampleCount, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Sum over ranks of n_r / N * grad_r: the gradient of the mean over the global batch."""
    buffer = bucket.buffer()
    if state.scale is None:
        raise BuilderError(
            "ddp(normalize_by='global_samples'): backward ran before any forward "
            "through the wrapper, so the sample count is unknown"
        )
    if state.local == 0:
        buffer.zero_()  # an empty batch's mean loss is NaN; it contributes nothing
    else:
        buffer.mul_(state.scale)
    return state.strategy.all_reduce_async(
        buffer, name="ddp: gradient bucket all_reduce", group=state.mesh
    ).future()


# DDP compares the hook's annotations with the real types; `from __future__ import annotations`
# turned them into strings.
_global_samples_hook.__annotations__.update(
    bucket=dist.GradBucket, state=_SampleCount, **{"return": torch.futures.Future[torch.Tensor]}
)


class GlobalSamplesDDP(DistributedDataParallel):
    """DistributedDataParallel whose gradient is the mean over all ranks' samples, not ranks."""

    def __init__(
        self,
        module: nn.Module,
        strategy: ManualParallelStrategy,
        mesh: DeviceMesh | None = None,
        **kwargs: Any,
    ) -> None:
        group = strategy.group if mesh is None else mesh.get_group()
        super().__init__(module, process_group=group, **kwargs)
        self._samples = _SampleCount(strategy, mesh)
        self.register_comm_hook(self._samples, _global_samples_hook)

    def set_batch_size(self, n: int) -> None:
        """This rank's sample count for the next forward (overrides the inferred one)."""
        self._samples.explicit = _checked_count(n)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self._samples.record(inputs, kwargs, sync=self.require_backward_grad_sync)
        return super().forward(*inputs, **kwargs)


def set_batch_size(model: nn.Module, n: int) -> None:
    """Set this rank's sample count for the next forward of every global-samples ddp part.

    Works on the whole model (the ddp part may be a submodule); a no-op at world size 1.
    """
    n = _checked_count(n)
    parts = [m for m in model.modules() if isinstance(m, GlobalSamplesDDP)]
    for part in parts:
        part.set_batch_size(n)
    if not parts and not any(
        getattr(m, _NORMALIZE_MARK, None) == "global_samples" for m in model.modules()
    ):
        raise BuilderError(
            f"set_batch_size(): {type(model).__name__} has no part wrapped with "
            "ddp(..., normalize_by='global_samples'); the batch size would be ignored"
        )


def infer_batch_size(inputs: tuple, kwargs: Mapping[str, Any]) -> int:
    """First dimension of the first tensor in the forward's arguments (depth first)."""
    tensor = _first_tensor((inputs, kwargs))
    if tensor is None or tensor.dim() == 0:
        found = "a 0-dim tensor" if tensor is not None else "no tensor"
        raise BuilderError(
            f"ddp(normalize_by='global_samples'): cannot infer this rank's batch size, the "
            f"forward's inputs hold {found}; call set_batch_size(model, n) before the forward"
        )
    return int(tensor.shape[0])


def _first_tensor(tree: Any) -> torch.Tensor | None:
    if isinstance(tree, torch.Tensor):
        return tree
    if not isinstance(tree, (Mapping, list, tuple)):
        return None
    for child in tree.values() if isinstance(tree, Mapping) else tree:
        found = _first_tensor(child)
        if found is not None:
            return found
    return None


def _checked_count(n: int) -> int:
    try:
        count = operator.index(n)  # int, numpy or 0-dim integer tensor; not float
    except TypeError:
        count = -1
    if isinstance(n, bool) or count < 0:
        raise BuilderError(f"set_batch_size(): n must be an integer >= 0, got {n!r}")
    return count
