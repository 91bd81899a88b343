"""Saving a sharded checkpoint in the background: training goes on while the files are written.

The call itself, on the main thread and the main group, does what must see this step's values:
it checks the target, serializes the small object files and copies every tensor to CPU memory
(torch's DCP stager; a sharded table's blocks here). Then `torch.distributed.checkpoint
.async_save` writes the copy from a thread, over a process group of its own (gloo), and a second
thread waits for it, writes the object files and commits exactly as a synchronous save does:
every rank reports its files written, then rank 0 writes the manifest and renames
`.name.partial` into place. A crash before that leaves the previous checkpoint the latest one.

Cost: a CPU copy of this rank's tensors (memory and a memcpy on the critical path), one small
agreement on the main group, and the writes competing with training for CPU and disk.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from manualpar.checkpoint.agreement import OnGroup, Ranks, agree, agree_on_path, dcp_call
from manualpar.checkpoint.files import partial_path, prepare
from manualpar.checkpoint.local_shards import Block, LocalShards
from manualpar.checkpoint.save import (
    commit,
    make_manifest,
    serialize_objects,
    state_dicts,
    write_blobs,
)
from manualpar.checkpoint.spill import check_room, spill_blocks
from manualpar.checkpoint.state import split_leaves, validate_state

__all__ = ["PendingSave", "save_checkpoint_async"]

log = logging.getLogger("manualpar.checkpoint")


class PendingSave:
    """A checkpoint being written in the background. `wait()` returns its path once committed on
    every rank, or raises the save's CheckpointError/CollectiveError (nothing was committed)."""

    def __init__(self, path: Path, future: Future[Path]) -> None:
        self.path, self._future = path, future

    def done(self) -> bool:
        return self._future.done()

    def wait(self) -> Path:
        return self._future.result()


def save_checkpoint_async(
    strategy: Ranks,
    path: str | os.PathLike,
    state: Mapping[str, Any],
    *,
    group: dist.ProcessGroup | None,
    overwrite: bool = True,
) -> PendingSave:
    """Start saving `state` as a sharded checkpoint (collective); see the module docstring.

    `group`: the process group the background writes use (the strategy's checkpoint group,
    never the main one; None on one process). Values are snapshotted before this returns, so
    the caller may update the model and optimizer right away.
    """
    import torch.distributed.checkpoint as dcp

    from manualpar.checkpoint.writer import NamingWriter  # with DCP: imported when saving

    path = Path(path).absolute()
    validate_state(state)
    agree_on_path(strategy, "save_checkpoint_async", path)
    started = time.perf_counter()
    staging = partial_path(path)
    shared, per_rank = state_dicts(state, full=False)
    tensors, objects = split_leaves(shared)
    needed = sum(math.prod(t.shape) * t.element_size() for t in tensors.values())
    manifest = make_manifest(strategy, state, "sharded")

    def snapshot() -> tuple[dict[str, bytes], dict[str, Any]]:
        if strategy.is_global_zero:
            prepare(path, staging, overwrite, make_dir=True, needed=needed)
        return serialize_objects(strategy, objects, per_rank), stage_to_cpu(tensors)

    blobs, staged = agree(strategy, f"preparing checkpoint {path}", snapshot)
    background = OnGroup(strategy, group)
    upload = dcp.async_save(
        staged,
        storage_writer=NamingWriter(staging),
        process_group=group,
        async_stager=_AlreadyStaged(),
        no_dist=not background.is_distributed,
    )
    assert isinstance(upload, Future)  # a stager without a future of its own: a plain Future
    stalled = time.perf_counter() - started

    def finish() -> Path:
        dcp_call(background, f"save_checkpoint({path}): writing tensor shards", upload.result)
        agree(
            background,
            f"save_checkpoint({path}): writing objects",
            lambda: write_blobs(staging, blobs),
        )
        commit(background, path, staging, manifest)
        if strategy.is_global_zero:
            log.info(
                "saved checkpoint %s in %.2fs (training waited %.2fs)",
                path,
                time.perf_counter() - started,
                stalled,
            )
        return path

    return PendingSave(path, _in_thread(finish, f"manualpar-save-{path.name}"))


def stage_to_cpu(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """A CPU copy of every tensor leaf, so training may change the originals while the copy is
    written. torch's DCP stager copies tensors and DTensors; a LocalShards (a sharded table's
    blocks, storage-less) is rebuilt around copies of its blocks, a disk table's in a file
    beside it (spill.py)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    shards = {k: v for k, v in tensors.items() if isinstance(v, LocalShards)}
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        staged = stager.stage({k: v for k, v in tensors.items() if k not in shards})
    finally:
        stager.close()
    assert isinstance(staged, dict)  # synchronous staging returns the state dict itself
    check_room(b for value in shards.values() for b in value.blocks)  # all copies, before any
    for key, value in shards.items():
        spilled = [b for b in value.blocks if b.spill_dir is not None]
        blocks = []
        if spilled:  # a disk table's: copied into a file beside it, not into memory
            directory = spilled[0].spill_dir
            assert directory is not None and all(b.spill_dir == directory for b in spilled)
            blocks = spill_blocks(spilled, directory)
        for b in value.blocks:
            if b.spill_dir is None:
                if b.prepare is not None:
                    b.prepare()
                blocks.append(Block(b.offsets, b.tensor.detach().to("cpu", copy=True), b.primary))
        staged[key] = LocalShards(value.shape, blocks, value.dtype)
    return staged


class _AlreadyStaged:
    """The stager async_save gets: the state dict is already a private CPU copy."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _in_thread(fn: Callable[[], Path], name: str) -> Future[Path]:
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    future = executor.submit(fn)
    future.add_done_callback(lambda _: executor.shutdown(wait=False))
    return future
