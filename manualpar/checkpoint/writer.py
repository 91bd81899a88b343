"""DCP's file writer, with failed writes naming their file.

torch's FileSystemWriter reports a full disk as "[Errno 28] No space left on device" (or
"[Errno 27] File too large" past a file-size limit) without the file, wrapped by DCP in a
traceback of every failing rank. This writer re-raises such an error naming the file this rank
was writing, so the save's error can say which rank and which file failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.futures import Future

from manualpar.checkpoint.files import with_file

__all__ = ["NamingWriter"]


class NamingWriter(dcp.FileSystemWriter):
    """A FileSystemWriter whose OSErrors name the file being written."""

    def write_data(self, plan: Any, planner: Any) -> Future[Any]:
        try:
            return super().write_data(plan, planner)
        except OSError as error:
            raise with_file(error, self._last_file(plan.storage_data.prefix)) from None

    def finish(self, metadata: Any, results: Any) -> None:
        try:
            super().finish(metadata, results)
        except OSError as error:
            raise with_file(error, Path(self.path) / ".metadata") from None

    def _last_file(self, prefix: str) -> Path:
        """The file this rank created last (files are written one after the other)."""
        mine = list(Path(self.path).glob(f"{prefix}*{DEFAULT_SUFFIX}"))
        return max(mine, key=lambda f: f.stat().st_mtime_ns) if mine else Path(self.path)
