"""DCP's file reader, reading plain tensors straight into the state, with failed reads naming
their file and byte range.

torch's FileSystemReader reports a short or damaged file with the cause only, and some causes
carry no message at all (a read past the end of a cut file), so a failed load said "failed on
rank 0: " and nothing else. This reader re-raises such an error naming the file and the bytes it
was reading. Loads check the files before reading them (checkpoint/verify.py), so this is what
a file that changed or failed during the read itself reports. Each plain tensor is read with
one read into its target (checkpoint/direct.py); the rest through FileSystemReader. Blocks
with a write hook (a disk table's) are read into a buffer and written by the hook
(checkpoint/block_writes.py).
"""

from __future__ import annotations

import io
from dataclasses import replace
from typing import IO, Any, cast

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from manualpar.checkpoint.block_writes import BlockWrites
from manualpar.checkpoint.direct import read_into_target
from manualpar.checkpoint.files import describe_failure
from manualpar.errors import CheckpointError

__all__ = ["NamingReader"]


class NamingReader(dcp.FileSystemReader):
    """A FileSystemReader that reads plain tensors straight into their targets and whose
    failures name the file and byte range being read."""

    _reading: str | None = None

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self._reading = _where(sinfo)
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._reading = None
        planner = cast(LoadPlanner, BlockWrites(planner))  # a disk table's blocks: pwrite
        try:
            rest = self._read_direct(plan.items, planner)
            return super().read_data(replace(plan, items=rest), planner)
        except Exception as error:
            where = self._reading or "a tensor file"  # the caller names the checkpoint
            raise CheckpointError(f"{where}: {describe_failure(error)}") from error

    def _read_direct(self, items: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """Read every plain tensor of `items` into its target; return the others."""
        by_file: dict[str, list[ReadItem]] = {}
        for item in items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        rest = []
        for relative_path, reads in by_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as file:
                for item in reads:
                    info = self.storage_data[item.storage_index]
                    self._reading = _where(info)
                    if not read_into_target(cast(io.BufferedIOBase, file), info, item, planner):
                        rest.append(item)
        return rest


def _where(info: Any) -> str:
    return f"{info.relative_path} (bytes {info.offset}-{info.offset + info.length})"
