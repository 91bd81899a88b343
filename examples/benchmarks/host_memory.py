"""Where a benchmark's fresh pages come from (Linux; elsewhere every figure is None).

On a virtual machine whose balloon reports free memory to the host (free page reporting), free
blocks of `page_reporting_order` and above (2 MiB and up on x86) are handed back to the host, which
must supply them again when they are next touched; smaller free fragments are never reported.
A fresh 2 MiB page always comes from such a block, while 4 KiB pages come from the fragments while
there are any. `free_memory` tells the two apart, so a cold init measurement can say which kind of
memory it drew from; `huge_mib` says how much of a process's memory is on 2 MiB pages.
"""

from __future__ import annotations

import resource
from pathlib import Path

__all__ = ["free_memory", "huge_mib", "minor_faults"]

BUDDYINFO = Path("/proc/buddyinfo")
REPORTING = Path("/sys/module/page_reporting/parameters")
PAGE_KIB = 4


def free_memory() -> dict[str, float | int | None]:
    """Free MiB in blocks below the reporting order (never handed back: cheap to touch) and at or
    above it (handed back when reporting is on), the order, and the MiB reported so far where the
    kernel says."""
    order = _read_int(REPORTING / "page_reporting_order")
    reported = _read_int(REPORTING / "reported_kib")
    found: dict[str, float | int | None] = {
        "reporting_order": order,
        "free_below_order_mib": None,
        "free_at_order_mib": None,
        "reported_mib": None if reported is None else reported / 1024,
    }
    if not BUDDYINFO.exists():
        return found
    split = 9 if order is None else order
    below = above = 0
    for line in BUDDYINFO.read_text().splitlines():
        counts = [int(count) for count in line.split()[4:]]  # "Node 0, zone Normal c0 c1 ..."
        for block_order, count in enumerate(counts):
            kib = count * PAGE_KIB << block_order
            if block_order < split:
                below += kib
            else:
                above += kib
    found["free_below_order_mib"], found["free_at_order_mib"] = below / 1024, above / 1024
    return found


def huge_mib() -> float | None:
    """This process's anonymous memory on 2 MiB pages (transparent huge pages), MiB."""
    path = Path("/proc/self/smaps_rollup")
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return None


def minor_faults() -> int:
    """Page faults this process took without I/O, so far (a 2 MiB page is one fault)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
