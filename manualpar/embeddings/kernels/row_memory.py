"""Table memory: CPU blocks backed by 2 MiB pages where the OS allows it.

Lookups and fused updates touch rows scattered over the whole table, so on CPU with 4 KiB pages
nearly every row costs a TLB miss; with transparent huge pages a random row update measured
about 1.8x faster (1M x 64 fp32 rows). Linux only hands huge pages to memory that asks for them
(`madvise` mode, the common default), before the pages are first touched: so blocks are
allocated empty, advised, and only then written. Elsewhere this is a plain `torch.empty`.
Zeroed blocks (optimizer state) are fresh mappings that no pass writes (`zeros_rows`).

The cost is paid once, at init, by the first touch of each page, and it is the host's where the
host takes free memory back: a virtual machine whose balloon reports free 2 MiB blocks to the
host gets every fresh huge page supplied again on first touch (measured 4-5 ms a page, 2.0-2.4 s
of system time for 1 GiB, however the pages are first touched), while 4 KiB pages come from
smaller free blocks it keeps (0.35 s for 1 GiB). Pages freed a second before are still backed
(0.03-0.7 s for 1 GiB; docs/benchmarks.md, "Embedding init against TorchRec").
`MANUALPAR_HUGE_PAGES=0` turns the advice off (the benchmark's step then took 1.29x).

Blocks are packed: every CPU block of at least 64 KiB is carved from a shared mapping that
starts on a 2 MiB boundary and is advised whole (`_carve`), one after another, so a table's
block and its optimizer state share huge pages. Advising each block's own 2 MiB-aligned interior
left a 12.8 MB table's unaligned head and tail (1-18% of it) and its whole 800 KB row-wise
state on 4 KiB pages: packed, 13 such tables' lookup and update took 0.91x the thread time
(docs/benchmarks.md, "CPU kernels and huge pages"). A mapping is unmapped when the last block
carved from it is freed; its memory is never handed to a second block, so a carved block is zero
until written. While siblings live, a freed block's memory goes back to the OS at once
(`_release`, `MADV_DONTNEED`): the whole 2 MiB pages of the gap between its live neighbours (a
page a live block shares is kept whole, so no live block's huge page is split).
"""

from __future__ import annotations

import bisect
import ctypes
import math
import mmap
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["agreed_available_bytes", "available_bytes", "empty_rows", "zeros_rows"]

HUGE_PAGE = 2 * 2**20
ENV_SWITCH = "MANUALPAR_HUGE_PAGES"
_MADV_HUGEPAGE = 14
_MADV_DONTNEED = 4
_libc: ctypes.CDLL | None = None
MAPPING = 64 * 2**20  # a shared mapping's size: a rank's tables and states fill a few
SMALLEST_CARVED = 64 * 2**10  # smaller blocks stay on the allocator's heap
_ALIGN = 64  # each carved block's start, as torch's own allocator aligns
# reentrant: a block freed by a garbage collection inside `_carve` releases under the lock
_lock = threading.RLock()


class _Mapping:
    """A shared mapping: its memory, the address of its first byte, the (start, end) offsets
    of its live blocks in order, the next free offset and its end. The blocks' finalizers keep
    it alive."""

    __slots__ = ("__weakref__", "address", "end", "live", "memory", "next")

    def __init__(self, memory: mmap.mmap, address: int, start: int, end: int) -> None:
        self.memory, self.address, self.next, self.end = memory, address, start, end
        self.live: list[tuple[int, int]] = []


# the mapping blocks are carved from now (weakly: the blocks keep it alive)
_current: weakref.ref[_Mapping] | None = None


def _madvise_huge(tensor: torch.Tensor) -> bool:
    """Advise the 2 MiB-aligned interior of a CPU tensor's memory; False if not possible."""
    global _libc
    if (
        not sys.platform.startswith("linux")
        or tensor.device.type != "cpu"
        or os.environ.get(ENV_SWITCH, "1") == "0"
    ):
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return False
    return _madvise_range(first, last - first)


def _madvise_range(start: int, length: int) -> bool:
    """MADV_HUGEPAGE on [start, start + length); False if the OS refused."""
    return _madvise(start, length, _MADV_HUGEPAGE)


def _madvise(start: int, length: int, advice: int) -> bool:
    """madvise(2) on [start, start + length); False if the OS refused."""
    global _libc
    if _libc is None:
        # the process's own symbols hold libc's: find_library("c") runs `ldconfig -p` in a
        # subprocess (15 ms of each shard_embeddings, measured)
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) == 0


def _release(mapping: _Mapping, block: tuple[int, int]) -> None:
    """A carved block's finalizer: forget it, and hand the whole 2 MiB pages between its live
    neighbours (or the carving frontier) back to the OS. Pages a live block shares stay whole
    (a partial MADV_DONTNEED would split a live block's huge page); the mapping stays, unmapped
    with its last block."""
    with _lock:
        live = mapping.live
        index = bisect.bisect_left(live, block)
        del live[index]
        if not live:  # the last block: the mapping goes with this finalizer's reference
            return
        low = live[index - 1][1] if index > 0 else 0
        high = live[index][0] if index < len(live) else mapping.next
    first = -(-(mapping.address + low) // HUGE_PAGE) * HUGE_PAGE
    last = (mapping.address + high) // HUGE_PAGE * HUGE_PAGE
    if last > first:  # never carved again: the frontier only moves forward
        _release_range(first, last - first)


def _release_range(start: int, length: int) -> None:
    """MADV_DONTNEED: the pages go back to the OS now (read again, they are zero)."""
    _madvise(start, length, _MADV_DONTNEED)


def _carved(
    shape: tuple[int, ...], device: torch.device | str | None, dtype: torch.dtype | None
) -> torch.dtype | None:
    """The block's dtype if it is to be carved (CPU, Linux, advice on, at least 64 KiB), else
    None."""
    probe = torch.empty(0, device=device, dtype=dtype)
    nbytes = math.prod(shape) * probe.element_size()
    if (
        probe.device.type != "cpu"
        or not sys.platform.startswith("linux")
        or os.environ.get(ENV_SWITCH, "1") == "0"
        or nbytes < SMALLEST_CARVED
    ):
        return None
    return probe.dtype


def _carve(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A block packed after the previous one in a 2 MiB-aligned, advised, anonymous mapping
    (fresh memory: zero until written); a new mapping when it does not fit. Freed, its pages go
    back to the OS (`_release`)."""
    global _current
    nbytes = math.prod(shape) * dtype.itemsize
    size = -(-nbytes // _ALIGN) * _ALIGN
    with _lock:
        mapping = _current() if _current is not None else None
        if mapping is None or mapping.end - mapping.next < size:
            length = max(MAPPING, -(-size // HUGE_PAGE) * HUGE_PAGE)
            # one huge page more than used, so that an aligned start lies inside; its unused
            # pages are never touched and take no memory
            memory = mmap.mmap(-1, length + HUGE_PAGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            address = torch.frombuffer(memory, dtype=torch.uint8, count=1).data_ptr()
            start = -address % HUGE_PAGE
            _madvise_range(address + start, length)
            mapping = _Mapping(memory, address, start, start + length)
            _current = weakref.ref(mapping)
        block = (mapping.next, mapping.next + nbytes)
        bisect.insort(mapping.live, block)  # live before the frontier moves past it
        mapping.next += size
    # the view alone holds the tensor's storage: its finalizer runs when the storage is freed
    view = memoryview(mapping.memory)[block[0] : block[1]]
    flat = torch.frombuffer(view, dtype=torch.uint8)
    weakref.finalize(view, _release, mapping, block).atexit = False
    return flat.view(dtype).view(shape)


def empty_rows(
    *shape: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """torch.empty, on huge pages when large enough: carved (the module's docstring)."""
    if (carved := _carved(shape, device, dtype)) is not None:
        return _carve(shape, carved)
    tensor = torch.empty(*shape, device=device, dtype=dtype)
    if tensor.numel() * tensor.element_size() >= 2 * HUGE_PAGE:
        _madvise_huge(tensor)
    return tensor


def zeros_rows(
    *shape: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """torch.zeros, on huge pages when large enough. A large CPU block on Linux is fresh
    anonymous memory, which the OS zeroes as each page is first written: no pass writes the
    zeros at init, and pages no update touches take no memory; the first update to write a
    page pays for it instead. Adam's state is twice the table: init of 2 x 1M x 64 measured
    0.07-0.91 s of CPU instead of 1.90-2.83 s, peak RSS 0.70 instead of 1.65 GiB
    (docs/benchmarks.md, "Embedding init against TorchRec")."""
    if (carved := _carved(shape, device, dtype)) is not None:
        return _fresh_zeros(shape, carved)
    probe = torch.empty(0, device=device, dtype=dtype)  # advice off: a mapping of its own
    nbytes = math.prod(shape) * probe.element_size()
    if probe.device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < 2 * HUGE_PAGE:
        return empty_rows(*shape, device=device, dtype=dtype).zero_()
    return _fresh_zeros(shape, probe.dtype)


def _fresh_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor on fresh anonymous memory (zero until written): carved where the advice is on,
    else on its own mapping; the tensor keeps the mapping alive."""
    if os.environ.get(ENV_SWITCH, "1") != "0" and math.prod(shape) * dtype.itemsize > 0:
        return _carve(shape, dtype)
    memory = mmap.mmap(-1, math.prod(shape) * dtype.itemsize, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(memory, dtype=dtype).view(shape)
    _madvise_huge(tensor)
    return tensor


def available_bytes(device: torch.device) -> int | None:
    """Memory this process could still allocate on `device`: the GPU's free memory, or the host's
    MemAvailable (Linux); None where it cannot be told."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu" or not os.path.exists("/proc/meminfo"):
        return None
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts KiB
    return None


def agreed_available_bytes(strategy: ManualParallelStrategy) -> int | None:
    """The memory every rank can still allocate (the smallest over ranks; on the CPU a node's
    ranks share the host's, so each counts its share), the same number on every rank so that
    each plans alike; None if some rank cannot tell. A collective: every rank must call it."""
    free = available_bytes(strategy.device)
    if free is not None and strategy.device.type == "cpu":
        free //= strategy.environment.local_world_size
    agreed = strategy.all_reduce(torch.tensor(-1 if free is None else free), op="min")
    return None if int(agreed) < 0 else int(agreed)
