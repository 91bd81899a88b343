"""Point-to-point sends and receives between two ranks of a group, started asynchronously.

`ManualParallelStrategy` inherits these with the collectives (collectives.py): the same timeout,
the same CollectiveError naming the operation and this rank, refused after teardown. A send
and its receive match by their peer, group and `tag`; two sends of one tag between the same
pair arrive in the order they were started. Used where only a pair of ranks knows that
something must travel (an embedding step's ids beyond the room its exchange kept for them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from manualpar.errors import ConfigError
from manualpar.strategy.collectives import Collectives, Group, PendingCollective

__all__ = ["PointToPoint"]


class PointToPoint(Collectives):
    """`send_async` / `receive_async` over the strategy's group or a given one."""

    def _peer(self, operation: str, peer: int, group: Group) -> tuple[int, dist.ProcessGroup]:
        """`peer` (a rank of `group`, not this one) as torch's global rank, and the group."""
        if not self.is_distributed or self.group_size(group) == 1:
            raise ConfigError(
                f"{operation}: a point-to-point transfer needs another rank, but the group has "
                "one; skip it when the group size is 1"
            )
        if peer == self.group_rank(group):
            raise ConfigError(
                f"{operation}: rank {peer} is this rank; a rank cannot send to or receive from "
                "itself, copy the tensor instead"
            )
        global_peer = self._check_src(operation, peer, group)
        over = self._group(operation, group)
        assert over is not None
        return global_peer, over

    def send_async(
        self,
        tensor: torch.Tensor,
        dst: int,
        *,
        tag: int = 0,
        name: str = "send",
        group: Group = None,
    ) -> PendingCollective:
        """Start sending a contiguous `tensor` to rank `dst` of `group`; `wait()` returns once
        it left (keep the tensor unchanged until then)."""
        self._check_open(name)
        global_dst, over = self._peer(name, dst, group)
        tensor = tensor.contiguous()
        with self.collective_guard(f"{name} (to rank {dst})"):
            work = dist.isend(tensor, dst=global_dst, group=over, tag=tag)
        return PendingCollective(self, work, tensor, tensor, f"{name} (to rank {dst})")

    def receive_async(
        self,
        tensor: torch.Tensor,
        src: int,
        *,
        tag: int = 0,
        name: str = "receive",
        group: Group = None,
    ) -> PendingCollective:
        """Start receiving into the contiguous `tensor` (its shape and dtype those of the send)
        from rank `src` of `group`; `wait()` returns it once filled."""
        self._check_open(name)
        if not tensor.is_contiguous():
            raise ConfigError(f"{name}: receives into a contiguous tensor only")
        global_src, over = self._peer(name, src, group)
        with self.collective_guard(f"{name} (from rank {src})"):
            work = dist.irecv(tensor, src=global_src, group=over, tag=tag)
        return PendingCollective(self, work, tensor, tensor, f"{name} (from rank {src})")
