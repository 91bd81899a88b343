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
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from manualpar.strategy import ManualParallelStrategy

__all__ = ["agreed_available_bytes", "available_bytes", "empty_rows", "zeros_rows"]

HUGE_PAGE = 2 * 2**20
ENV_SWITCH = "MANUALPAR_HUGE_PAGES"
_MADV_HUGEPAGE = 14
_libc: ctypes.CDLL | None = None


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
    if _libc is None:
        # the process's own symbols hold libc's: find_library("c") runs `ldconfig -p` in a
        # subprocess (15 ms of each shard_embeddings, measured)
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_HUGEPAGE) == 0


def empty_rows(
    *shape: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """torch.empty, on huge pages when large enough (do not write it before this returns)."""
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
    probe = torch.empty(0, device=device, dtype=dtype)
    nbytes = math.prod(shape) * probe.element_size()
    if probe.device.type != "cpu" or not sys.platform.startswith("linux") or nbytes < 2 * HUGE_PAGE:
        return empty_rows(*shape, device=device, dtype=dtype).zero_()
    return _fresh_zeros(shape, probe.dtype)


def _fresh_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor on its own private anonymous mapping (zero until written), advised to huge
    pages; the tensor keeps the mapping alive."""
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
