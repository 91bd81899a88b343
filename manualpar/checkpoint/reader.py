"""DCP's file reader, with failed reads naming their file and byte range.

torch's FileSystemReader reports a short or damaged file with the cause only, and some causes
carry no message at all (a read past the end of a cut file), so a failed load said "failed on
rank 0: " and nothing else. This reader re-raises such an error naming the file and the bytes it
was reading. Loads check the files before reading them (checkpoint/verify.py), so this is what
a file that changed or failed during the read itself reports.
"""

from __future__ import annotations

from typing import IO, Any

import torch.distributed.checkpoint as dcp
from torch.futures import Future

from manualpar.checkpoint.files import describe_failure
from manualpar.errors import CheckpointError

__all__ = ["NamingReader"]


class NamingReader(dcp.FileSystemReader):
    """A FileSystemReader whose failures name the file and byte range being read."""

    _reading: str | None = None

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self._reading = (
            f"{sinfo.relative_path} (bytes {sinfo.offset}-{sinfo.offset + sinfo.length})"
        )
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except Exception as error:
            where = self._reading or "a tensor file"  # the caller names the checkpoint
            raise CheckpointError(f"{where}: {describe_failure(error)}") from error
