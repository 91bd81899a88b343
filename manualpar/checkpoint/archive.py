"""torch.save archives inside DCP's tensor files: a seekable view of one, and where a stored
member's bytes start in it.

Each saved tensor (or block of one) is a zip archive of its own (torch.save's format) at a byte
range of a `*.distcp` file. Checking a file (checkpoint/verify.py) and reading a tensor straight
into its target (checkpoint/direct.py) both open one archive at a time through this view.
"""

from __future__ import annotations

import io
import struct
import zipfile
from typing import Any

__all__ = ["LOCAL_HEADER_SIZE", "ArchiveSlice", "data_start"]

# a zip member's local header: signature, versions and flags, ..., name and extra lengths
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_LOCAL_MAGIC = b"PK\x03\x04"
LOCAL_HEADER_SIZE = _LOCAL_HEADER.size


def data_start(header: bytes | memoryview, length: int, member: zipfile.ZipInfo) -> int:
    """Where a stored member's bytes start in its archive of `length` bytes, from its local
    header (`header`: the LOCAL_HEADER_SIZE bytes at member.header_offset), whose extra field,
    torch's alignment padding, differs from the directory's. Raises zipfile.BadZipFile."""
    if member.header_offset + LOCAL_HEADER_SIZE > length or len(header) < LOCAL_HEADER_SIZE:
        raise zipfile.BadZipFile(f"the header of {member.filename!r} lies past the end")
    fields = _LOCAL_HEADER.unpack_from(header)
    if fields[0] != _LOCAL_MAGIC:
        raise zipfile.BadZipFile(f"bad magic number for the header of {member.filename!r}")
    start = member.header_offset + LOCAL_HEADER_SIZE + fields[-2] + fields[-1]
    if start + member.file_size > length:
        raise zipfile.BadZipFile(f"the bytes of {member.filename!r} run past the end")
    return start


class ArchiveSlice(io.RawIOBase):
    """A read-only, seekable view of `length` bytes of `handle` from `offset` (one saved
    tensor's archive, which zipfile and torch.load read as if it were a file of its own)."""

    def __init__(self, handle: io.BufferedIOBase, offset: int, length: int) -> None:
        super().__init__()
        self.handle, self.offset, self.length, self.position = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, start + position)
        return self.position

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self.length - self.position))
        self.handle.seek(self.offset + self.position)
        read = self.handle.readinto(memoryview(buffer)[:count])
        self.position += read
        return read
