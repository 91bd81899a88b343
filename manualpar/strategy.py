"""ManualParallelStrategy: ranks, the process group, the device, collectives and checkpoint IO.

The strategy never wraps, moves or shards a module: the user's module does that in its own
`setup(strategy)` with the builders. Everything here also works with world size 1 and no process
group, so the same script runs as a single process on a laptop.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from manualpar.checkpoint import io as checkpoint_io
from manualpar.environment import ClusterEnvironment, detect_environment
from manualpar.errors import CollectiveError
from manualpar.seed import seed_everything
from manualpar.timeouts import DEFAULT_TIMEOUT, TIMEOUT_ENV_VAR, resolve_timeout

__all__ = ["DEFAULT_TIMEOUT", "TIMEOUT_ENV_VAR", "ManualParallelStrategy", "ReduceOp"]

ReduceOp = Literal["mean", "sum", "max", "min"]
_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
T = TypeVar("T")
# Groups this process destroyed, kept referenced until interpreter exit. A DDP Reducer holds its
# group, and when a model is freed the Reducer's destructor (GIL held) joins gloo's worker
# threads, one of which may still need the GIL to drop a finished collective's tensors: a
# deadlock at exit. While this list holds the group, the last reference dies here instead, in
# the group's own Python binding, whose destructor releases the GIL.
_RETIRED_GROUPS: list[dist.ProcessGroup] = []


def pick_device(accelerator: str, local_rank: int) -> torch.device:
    """One device per local rank: cuda:<local_rank> on GPU nodes, else the CPU."""
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cpu":
        return torch.device("cpu")
    if accelerator != "cuda":
        raise ValueError(f"accelerator must be 'auto', 'cpu' or 'cuda', got {accelerator!r}")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"local rank {local_rank} needs cuda:{local_rank}, but this node shows {count} "
            "CUDA device(s); launch at most one process per GPU or set CUDA_VISIBLE_DEVICES"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


class ManualParallelStrategy:
    """Owns rank information, the process group, the device, collectives and checkpoint IO.

    Args:
        environment: rank information; detected from the launcher's variables if omitted.
        accelerator: "auto" (CUDA if present), "cpu" or "cuda".
        backend: process-group backend; by default gloo on CPU and "cpu:gloo,cuda:nccl" on CUDA
            (so CPU tensors such as metrics can still be reduced).
        timeout: collective timeout (seconds or timedelta); default $MANUALPAR_TIMEOUT_S or 5 min.
        process_group: adopt a group the caller already made instead of creating one.
        check_collectives: before reduce/broadcast, compare shapes and dtypes across ranks
            (one extra tiny collective) so a mismatch raises instead of corrupting or hanging.
    """

    def __init__(
        self,
        environment: ClusterEnvironment | None = None,
        *,
        accelerator: str = "auto",
        backend: str | None = None,
        timeout: float | timedelta | None = None,
        process_group: dist.ProcessGroup | None = None,
        check_collectives: bool = False,
    ) -> None:
        self.timeout = resolve_timeout(timeout)
        self.check_collectives = check_collectives
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        detected = environment or detect_environment()
        self.device = pick_device(accelerator, detected.local_rank)  # this process's own GPU
        self.environment = self._adopted_environment(detected, process_group)
        self.backend = backend or ("cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo")
        self._owns_group = False
        self._torn_down = False
        self.group: dist.ProcessGroup | None = process_group
        if self.group is None and self.world_size > 1:
            self.group = self._init_process_group()
            self._owns_group = True

    # ---- rank information -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.environment.rank

    @property
    def world_size(self) -> int:
        return self.environment.world_size

    @property
    def local_rank(self) -> int:
        return self.environment.local_rank

    @property
    def node_rank(self) -> int:
        return self.environment.node_rank

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.group is not None

    def __repr__(self) -> str:
        return (
            f"ManualParallelStrategy(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, device={self.device}, backend={self.backend!r}, "
            f"timeout={self.timeout.total_seconds():g}s, source={self.environment.source!r})"
        )

    def seed_everything(self, seed: int, per_rank: bool = False) -> int:
        """Seed python, numpy and torch; with per_rank, rank r uses seed + r (e.g. dropout)."""
        return seed_everything((seed + self.rank) % 2**32 if per_rank else seed)

    # ---- process group ----------------------------------------------------------------------
    @staticmethod
    def _adopted_environment(
        detected: ClusterEnvironment, group: dist.ProcessGroup | None
    ) -> ClusterEnvironment:
        """Ranks as seen inside an adopted group (a subgroup numbers its members from 0)."""
        if group is None:
            return detected
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError(
                "this process is not a member of the adopted process group; "
                "create the strategy only on the group's members"
            )
        is_world = group is dist.group.WORLD
        if (
            is_world
            and detected.source != "single"
            and (detected.rank, detected.world_size) != (rank, world)
        ):
            raise ValueError(
                f"the adopted process group has rank {rank} of {world}, but the {detected.source} "
                f"environment says rank {detected.rank} of {detected.world_size}; pass a matching "
                "ClusterEnvironment or the world group"
            )
        local_world = min(detected.local_world_size, world) if detected.source != "single" else 1
        return ClusterEnvironment(
            rank=rank,
            world_size=world,
            local_rank=min(detected.local_rank, local_world - 1),
            local_world_size=local_world,
            node_rank=detected.node_rank,
            master_addr=detected.master_addr or "adopted",
            master_port=detected.master_port or 1,
            restart_count=detected.restart_count,
            source="adopted",
        )

    def _init_process_group(self) -> dist.ProcessGroup:
        env = self.environment
        kwargs: dict[str, Any] = dict(
            backend=self.backend, rank=env.rank, world_size=env.world_size, timeout=self.timeout
        )
        try:
            # Under torchrun the agent already serves the store: join it. Its keys survive a
            # restart, so each attempt gets its own prefix (plain env:// init reuses the dead
            # attempt's gloo addresses and times out after a restart).
            store: dist.Store = dist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=env.rank == 0 and not env.uses_agent_store,
                timeout=self.timeout,
            )
            if env.uses_agent_store:
                store = dist.PrefixStore(f"manualpar/attempt_{env.restart_count}", store)
            dist.init_process_group(store=store, **kwargs)
        except Exception as error:
            raise CollectiveError(
                f"rank {env.rank} of {env.world_size} could not join the process group at "
                f"{env.master_addr}:{env.master_port} (backend {self.backend}) within "
                f"{self.timeout.total_seconds():g}s: {error}. Check that every rank was started "
                "and that the master address and port are reachable."
            ) from error
        return dist.group.WORLD

    def teardown(self, *, wait_for_peers: bool = True) -> None:
        """Destroy the process group if this strategy created it. Safe to call twice."""
        if self._owns_group and dist.is_initialized():
            # Let every rank finish its last collective first: destroying the group under a
            # peer still inside one (e.g. a DDP reducer's) can hang it.
            try:
                if wait_for_peers:
                    self.barrier("teardown")
            finally:
                if self.group is not None:
                    _RETIRED_GROUPS.append(self.group)
                dist.destroy_process_group()
        self._owns_group = False
        self.group = None
        self._torn_down = self.world_size > 1

    def __enter__(self) -> ManualParallelStrategy:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.teardown(wait_for_peers=exc_type is None)  # a failing rank must not wait for peers

    # ---- collectives ------------------------------------------------------------------------
    @contextmanager
    def _collective(self, operation: str) -> Iterator[None]:
        """Re-raise backend failures with the operation, this rank and what to check."""
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as error:
            raise CollectiveError(
                f"{operation} failed on rank {self.rank} of {self.world_size} "
                f"(backend {self.backend}, timeout {self.timeout.total_seconds():g}s): {error}. "
                "Another rank probably exited, stalled, or called a different collective; "
                "check the other ranks' logs."
            ) from error

    def _check_src(self, operation: str, src: int) -> int:
        """Validate a rank of this strategy's group; return it as torch's global rank."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"{operation}: rank {src} is not in [0, {self.world_size})")
        return dist.get_global_rank(self.group, src) if self.is_distributed else src

    def _check_open(self, operation: str) -> None:
        if self._torn_down:
            raise CollectiveError(
                f"{operation} called on rank {self.rank} after teardown(); the process group is "
                "gone, so the result would be this rank's value alone"
            )

    def _check_same_meta(self, operation: str, tensor: torch.Tensor) -> None:
        """All-gather (ndim, shape, dtype) and raise on the first rank that differs."""
        if tensor.dim() > 14:
            raise ValueError(f"{operation}: tensors with more than 14 dims are not supported")
        meta = torch.full((16,), -1, dtype=torch.int64, device=tensor.device)
        meta[0], meta[1] = tensor.dim(), _dtype_code(tensor.dtype)
        meta[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        gathered = [torch.empty_like(meta) for _ in range(self.world_size)]
        with self._collective(f"{operation} (shape check)"):
            dist.all_gather(gathered, meta, group=self.group)
        shapes = [tuple(g[2 : 2 + int(g[0])].tolist()) for g in gathered]
        codes = [int(g[1]) for g in gathered]
        if len(set(shapes)) > 1 or len(set(codes)) > 1:
            by_code = {_dtype_code(dtype): dtype for dtype in (*_KNOWN_DTYPES, tensor.dtype)}
            described = ", ".join(
                f"rank {r}: {shape} {by_code.get(code, '?')}"
                for r, (shape, code) in enumerate(zip(shapes, codes, strict=True))
            )
            raise CollectiveError(
                f"{operation}: ranks passed tensors of different shapes or dtypes ({described}); "
                "every rank must pass the same shape and dtype"
            )

    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank arrives (or raise CollectiveError after the timeout)."""
        label = f"barrier({name!r})" if name else "barrier"
        self._check_open(label)
        if not self.is_distributed:
            return
        with self._collective(label):
            if self.device.type == "cuda":
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)

    def broadcast(self, obj: T, src: int = 0) -> T:
        """Send `obj` from rank `src` to all ranks and return it.

        A tensor is broadcast into the tensor each rank passed (same shape and dtype everywhere,
        as in torch). Any other object is pickled; pickle travels only between this job's ranks.
        """
        global_src = self._check_src("broadcast", src)
        self._check_open("broadcast")
        if not self.is_distributed:
            return obj
        if isinstance(obj, torch.Tensor):
            if self.check_collectives:
                self._check_same_meta("broadcast", obj)
            target = obj if obj.is_contiguous() else obj.contiguous()
            with self._collective(f"broadcast(tensor {tuple(obj.shape)}, src={src})"):
                dist.broadcast(target, src=global_src, group=self.group)
            if target is not obj:
                obj.copy_(target)
            return obj
        box = [obj if self.rank == src else None]
        with self._collective(f"broadcast(object, src={src})"):
            dist.broadcast_object_list(
                box, src=global_src, group=self.group, device=self._object_device
            )
        return box[0]  # type: ignore[return-value]

    def reduce(
        self, value: torch.Tensor | float, op: ReduceOp = "mean", dst: int | None = None
    ) -> torch.Tensor | None:
        """Reduce `value` over ranks into a new tensor (the input is left unchanged).

        With `dst=None` every rank gets the result; with `dst=r` only rank r does (others get
        None). "mean" of an integer tensor is returned as a floating tensor.
        """
        if op not in _TORCH_OPS:
            raise ValueError(f"reduce: op must be one of {sorted(_TORCH_OPS)}, got {op!r}")
        global_dst = None if dst is None else self._check_src("reduce", dst)
        self._check_open(f"reduce(op={op})")
        tensor = torch.as_tensor(
            value, device=self.device if not isinstance(value, torch.Tensor) else value.device
        )
        result = tensor.detach().clone()
        if op == "mean" and not (result.is_floating_point() or result.is_complex()):
            result = result.to(torch.get_default_dtype())
        if self.is_distributed:
            if self.check_collectives:
                self._check_same_meta(f"reduce(op={op})", result)
            label = f"reduce(op={op}, shape={tuple(result.shape)}" + (
                f", dst={dst})" if dst is not None else ")"
            )
            with self._collective(label):
                if dst is None:
                    dist.all_reduce(result, op=_TORCH_OPS[op], group=self.group)
                else:
                    dist.reduce(result, dst=global_dst, op=_TORCH_OPS[op], group=self.group)
            if dst is not None and self.rank != dst:
                return None
        if op == "mean":
            result /= self.world_size
        return result

    def all_reduce(self, value: torch.Tensor | float, op: ReduceOp = "mean") -> torch.Tensor:
        """`reduce` with the result on every rank."""
        result = self.reduce(value, op)
        assert result is not None
        return result

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack every rank's tensor into shape (world_size, *shape).

        Shapes and dtypes are compared first (one tiny extra collective); a mismatch raises
        CollectiveError naming each rank's shape.
        """
        self._check_open("all_gather")
        if not self.is_distributed:
            return tensor.detach().unsqueeze(0).clone()
        self._check_same_meta("all_gather", tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._collective(f"all_gather(shape={tuple(tensor.shape)})"):
            dist.all_gather(parts, tensor.detach().contiguous(), group=self.group)
        return torch.stack(parts)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order."""
        self._check_open("all_gather_object")
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._collective("all_gather_object"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    @property
    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    # ---- checkpoint IO ----------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: Mapping[str, Any],
        *,
        full: bool = False,
        overwrite: bool = True,
    ) -> Path:
        """Save `state` on all ranks (collective). See manualpar.checkpoint.save_checkpoint."""
        return checkpoint_io.save_checkpoint(self, path, state, full=full, overwrite=overwrite)

    def load_checkpoint(
        self, path: str | os.PathLike, state: dict[str, Any], *, strict: bool = True
    ) -> dict[str, Any]:
        """Load into `state` on all ranks (collective). See manualpar.checkpoint."""
        return checkpoint_io.load_checkpoint(self, path, state, strict=strict)


_KNOWN_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def _dtype_code(dtype: torch.dtype) -> int:
    """The same number on every rank for the same dtype (no per-process registry)."""
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF
