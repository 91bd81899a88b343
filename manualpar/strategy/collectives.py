"""Collectives: the only calls into torch.distributed's collectives in manualpar.

`ManualParallelStrategy` inherits these. Each runs over the strategy's group or a given one,
under the strategy's timeout, raises CollectiveError naming the operation and this rank on a
failure, refuses to run after teardown, and works with world size 1 and no process group.
Builders, embedding exchanges and checkpoints call these, never torch.distributed directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from manualpar.errors import CollectiveError, ConfigError
from manualpar.strategy.collective_meta import describe, mesh_dim, mismatch
from manualpar.strategy.differentiable import gather_with_gradient

__all__ = ["Collectives", "Group", "PendingCollective", "ReduceOp"]

# Where a collective runs: the strategy's group (None), a process group, or a 1-D device mesh
# (a dim of strategy.mesh(...), e.g. mesh["shard"]).
Group = dist.ProcessGroup | DeviceMesh | None

ReduceOp = Literal["mean", "sum", "max", "min"]
_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
T = TypeVar("T")


@dataclass
class PendingCollective:
    """A collective in flight: `wait()` gives its result (or raises CollectiveError naming it);
    `future()` gives a torch Future of it, for DDP communication hooks."""

    strategy: Collectives
    work: dist.Work | None
    result: torch.Tensor
    sent: torch.Tensor  # kept alive until the collective is done
    operation: str

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            with self.strategy.collective_guard(self.operation):
                self.work.wait()
            self.work = None
        return self.result

    def future(self) -> torch.futures.Future[torch.Tensor]:
        if self.work is None:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(self.result)
            return done
        result = self.result
        return self.work.get_future().then(lambda _: result)


class Collectives:
    """Collectives over the process group `group` (None: a single process, no group)."""

    group: dist.ProcessGroup | None
    device: torch.device
    backend: str
    timeout: timedelta
    check_collectives: bool
    failed_collective: str | None
    _torn_down: bool

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    @property
    def is_distributed(self) -> bool:
        return self.group is not None

    # ---- collectives ------------------------------------------------------------------------
    @contextmanager
    def collective_guard(self, operation: str) -> Iterator[None]:
        """Run a collective (or a library call that runs them, such as DCP): a backend failure
        is re-raised as CollectiveError naming the operation, this rank and what to check."""
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as error:
            lost = self._lost_ranks_note()
            if self.failed_collective is None:
                self.failed_collective = operation
            cause = (
                f"{lost}; check the other ranks' logs."
                if lost
                else "Another rank probably exited, stalled, or called a different collective; "
                "check the other ranks' logs."
            )
            raise CollectiveError(
                f"{operation} failed on rank {self.rank} of {self.world_size} "
                f"(backend {self.backend}, timeout {self.timeout.total_seconds():g}s): "
                f"{error}. {cause}"
            ) from error

    def _lost_ranks_note(self) -> str | None:
        """A sentence naming the ranks lost at this rank's first failure (None: unknown)."""
        return None

    def group_size(self, group: Group = None) -> int:
        """Ranks in `group` (default: the strategy's group; 1 without a process group)."""
        if isinstance(group, DeviceMesh):
            return mesh_dim(group).size()
        if group is None or not self.is_distributed:
            return self.world_size
        return dist.get_world_size(group)

    def group_rank(self, group: Group = None) -> int:
        """This rank's index inside `group` (its coordinate along a 1-D mesh)."""
        if isinstance(group, DeviceMesh):
            return mesh_dim(group).get_local_rank()
        if group is None or not self.is_distributed:
            return self.rank
        return dist.get_rank(group)

    def _group(self, operation: str, group: Group) -> dist.ProcessGroup | None:
        """The group a collective runs over; a subgroup needs a process group to exist."""
        if isinstance(group, DeviceMesh):
            group = None if not self.is_distributed else mesh_dim(group).get_group()
        if group is not None and not self.is_distributed:
            raise CollectiveError(
                f"{operation}: a group was given but the strategy has no process group "
                "(world size 1 or after teardown); pass group=None"
            )
        return self.group if group is None else group

    def _check_src(self, operation: str, src: int, group: Group = None) -> int:
        """Validate a rank of the group; return it as torch's global rank."""
        size = self.group_size(group)
        if not 0 <= src < size:
            raise ConfigError(f"{operation}: rank {src} is not in [0, {size})")
        over = self._group(operation, group)
        return src if over is None else dist.get_global_rank(over, src)

    def _check_open(self, operation: str) -> None:
        """Refuse a collective after teardown(), at every world size: on one process it could
        still answer, but the same script on N ranks cannot, and must fail the same way."""
        if self._torn_down:
            raise CollectiveError(
                f"{operation} called on rank {self.rank} after teardown(); the strategy's "
                "process group is gone, so the result would be this rank's value alone. Call "
                "teardown() once, after the script's last collective, mesh() and checkpoint "
                "save or load, or make a new ManualParallelStrategy to go on"
            )

    def _check_same_meta(self, operation: str, tensor: torch.Tensor, group: Group = None) -> None:
        """All-gather each rank's shape and dtype (collective_meta.py); raise naming every
        rank's if they differ."""
        meta = describe(operation, tensor)
        gathered = [torch.empty_like(meta) for _ in range(self.group_size(group))]
        with self.collective_guard(f"{operation} (shape check)"):
            dist.all_gather(gathered, meta, group=self._group(operation, group))
        described = mismatch(gathered, tensor.dtype)
        if described is not None:
            raise CollectiveError(
                f"{operation}: ranks passed tensors of different shapes or dtypes ({described}); "
                "every rank must pass the same shape and dtype"
            )

    def barrier(self, name: str | None = None, *, group: Group = None) -> None:
        """Wait until every rank arrives (or raise CollectiveError after the timeout)."""
        label = f"barrier({name!r})" if name else "barrier"
        self._check_open(label)
        if not self.is_distributed:
            return
        with self.collective_guard(label):
            if self.device.type == "cuda":
                dist.barrier(group=self._group(label, group), device_ids=[self.device.index])
            else:
                dist.barrier(group=self._group(label, group))

    def broadcast(self, obj: T, src: int = 0, *, group: Group = None) -> T:
        """Send `obj` from rank `src` (of `group`) to all ranks and return it.

        A tensor is broadcast into the tensor each rank passed (same shape and dtype everywhere,
        as in torch). Any other object is pickled; pickle travels only between this job's ranks.
        """
        self._check_open("broadcast")
        global_src = self._check_src("broadcast", src, group)
        if not self.is_distributed:
            return obj
        over = self._group("broadcast", group)
        if isinstance(obj, torch.Tensor):
            if self.check_collectives:
                self._check_same_meta("broadcast", obj, group)
            target = obj if obj.is_contiguous() else obj.contiguous()
            with self.collective_guard(f"broadcast(tensor {tuple(obj.shape)}, src={src})"):
                dist.broadcast(target, src=global_src, group=over)
            if target is not obj:
                obj.copy_(target)
            return obj
        box = [obj if dist.get_rank(over) == src else None]
        with self.collective_guard(f"broadcast(object, src={src})"):
            dist.broadcast_object_list(box, src=global_src, group=over, device=self._object_device)
        return box[0]  # type: ignore[return-value]

    def reduce(
        self,
        value: torch.Tensor | float,
        op: ReduceOp = "mean",
        dst: int | None = None,
        *,
        group: Group = None,
    ) -> torch.Tensor | None:
        """Reduce `value` over the ranks of `group` into a new tensor (the input is unchanged).

        With `dst=None` every rank gets the result; with `dst=r` only rank r does (others get
        None). "mean" of an integer tensor is returned as a floating tensor.
        """
        if op not in _TORCH_OPS:
            raise ConfigError(f"reduce: op must be one of {sorted(_TORCH_OPS)}, got {op!r}")
        self._check_open(f"reduce(op={op})")
        global_dst = None if dst is None else self._check_src("reduce", dst, group)
        tensor = torch.as_tensor(
            value, device=self.device if not isinstance(value, torch.Tensor) else value.device
        )
        result = tensor.detach().clone()
        if op == "mean" and not (result.is_floating_point() or result.is_complex()):
            result = result.to(torch.get_default_dtype())
        if self.is_distributed:
            over = self._group("reduce", group)
            if self.check_collectives:
                self._check_same_meta(f"reduce(op={op})", result, group)
            label = f"reduce(op={op}, shape={tuple(result.shape)}" + (
                f", dst={dst})" if dst is not None else ")"
            )
            with self.collective_guard(label):
                if global_dst is None:
                    dist.all_reduce(result, op=_TORCH_OPS[op], group=over)
                else:
                    dist.reduce(result, dst=global_dst, op=_TORCH_OPS[op], group=over)
            if dst is not None and dist.get_rank(over) != dst:
                return None
        if op == "mean":
            result /= self.group_size(group)
        return result

    def all_reduce(
        self,
        value: torch.Tensor | float,
        op: ReduceOp = "mean",
        *,
        group: Group = None,
    ) -> torch.Tensor:
        """`reduce` with the result on every rank."""
        result = self.reduce(value, op, group=group)
        assert result is not None
        return result

    def all_reduce_(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = "sum",
        *,
        name: str = "all_reduce",
        group: Group = None,
    ) -> torch.Tensor:
        """Reduce `tensor` over the ranks in place (no copy: for large buffers) and return it."""
        if op not in _TORCH_OPS:
            raise ConfigError(f"{name}: op must be one of {sorted(_TORCH_OPS)}, got {op!r}")
        self._check_open(name)
        if self.is_distributed and self.group_size(group) > 1:
            with self.collective_guard(f"{name} (op={op}, shape={tuple(tensor.shape)})"):
                dist.all_reduce(tensor, op=_TORCH_OPS[op], group=self._group(name, group))
        if op == "mean":
            tensor /= self.group_size(group)
        return tensor

    def all_reduce_async(
        self,
        tensor: torch.Tensor,
        *,
        name: str = "all_reduce",
        group: Group = None,
    ) -> PendingCollective:
        """Start a sum all-reduce of `tensor` in place; the result is `tensor` once waited."""
        self._check_open(name)
        work = None
        if self.is_distributed and self.group_size(group) > 1:
            with self.collective_guard(name):
                work = dist.all_reduce(tensor, group=self._group(name, group), async_op=True)
        return PendingCollective(self, work, tensor, tensor, name)

    def all_to_all_async(
        self,
        tensor: torch.Tensor,
        send_splits: list[int],
        receive_splits: list[int],
        *,
        name: str = "all_to_all",
        group: Group = None,
    ) -> PendingCollective:
        """Start an all_to_all_single of a flat `tensor`: `send_splits[r]` elements go to rank
        r, `receive_splits[r]` come from it. On one process nothing is sent (the splits to
        oneself must then be equal, and the tensor is returned as received)."""
        self._check_open(name)
        size = self.group_size(group)
        if len(send_splits) != size or len(receive_splits) != size:
            raise ConfigError(
                f"{name}: {len(send_splits)} send and {len(receive_splits)} receive splits for "
                f"{size} ranks; give one split per rank"
            )
        if sum(send_splits) != tensor.numel():
            raise ConfigError(
                f"{name}: the send splits add up to {sum(send_splits)} elements but the tensor "
                f"has {tensor.numel()}; send exactly the tensor's elements"
            )
        if not self.is_distributed or size == 1:
            return PendingCollective(self, None, tensor, tensor, name)
        tensor = tensor.contiguous()
        received = tensor.new_empty(sum(receive_splits))
        with self.collective_guard(name):
            work = dist.all_to_all_single(
                received,
                tensor,
                receive_splits,
                send_splits,
                group=self._group(name, group),
                async_op=True,
            )
        return PendingCollective(self, work, received, tensor, name)

    def all_to_all(
        self,
        tensor: torch.Tensor,
        send_splits: list[int],
        receive_splits: list[int],
        *,
        name: str = "all_to_all",
        group: Group = None,
    ) -> torch.Tensor:
        """The blocking `all_to_all_async`: the received tensor."""
        return self.all_to_all_async(
            tensor, send_splits, receive_splits, name=name, group=group
        ).wait()

    def all_gather(
        self,
        tensor: torch.Tensor,
        *,
        group: Group = None,
        differentiable: bool = False,
    ) -> torch.Tensor:
        """Stack every rank's tensor into shape (group size, *shape).

        Shapes and dtypes are compared first (one tiny extra collective); a mismatch raises
        CollectiveError naming each rank's shape. `differentiable=True` keeps the autograd
        graph: the gradient of this rank's slice is the sum of the gradients every rank's loss
        gave it (one all-reduce in backward), for losses over the global batch.
        """
        self._check_open("all_gather")
        if differentiable:
            return gather_with_gradient(self, tensor, group)
        if not self.is_distributed:
            return tensor.detach().unsqueeze(0).clone()
        self._check_same_meta("all_gather", tensor, group)
        parts = [torch.empty_like(tensor) for _ in range(self.group_size(group))]
        with self.collective_guard(f"all_gather(shape={tuple(tensor.shape)})"):
            dist.all_gather(
                parts, tensor.detach().contiguous(), group=self._group("all_gather", group)
            )
        return torch.stack(parts)

    def all_gather_object(self, obj: Any, *, group: Group = None) -> list[Any]:
        """Every rank's picklable object, in rank order."""
        self._check_open("all_gather_object")
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.group_size(group)
        with self.collective_guard("all_gather_object"):
            dist.all_gather_object(out, obj, group=self._group("all_gather_object", group))
        return out

    @property
    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None
