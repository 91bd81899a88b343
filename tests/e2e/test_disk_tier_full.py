"""The disk tier on a full disk, in a subprocess whose files may not grow past 4 KiB
(RLIMIT_FSIZE): reserving a table's file fails when the table is built, naming it."""

from __future__ import annotations

import textwrap
from pathlib import Path

from launch import run_python

FULL_DISK = """
import resource, signal
import manualpar as mp
from manualpar.embeddings import *
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
with mp.empty_init():
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("big", 4096, 4)], seed=1)
try:
    shard_embeddings(ebc, mp.ManualParallelStrategy(),
                     EmbeddingPlan(1, dict(big=row_wise(on_disk=True))), SGD(lr=0.1),
                     disk_tier=DiskTier(DIRECTORY, cache_rows=8))
except Exception as error:
    print(type(error).__name__ + ": " + str(error))
"""


def test_a_full_disk_is_reported_at_build_time(tmp_path: Path) -> None:
    """Simulated with RLIMIT_FSIZE (the file may not grow past 4 KiB): reserving the 64 KiB
    file fails as on a full disk, before any training."""
    script = textwrap.dedent(FULL_DISK).replace("DIRECTORY", repr(str(tmp_path)))
    run = run_python("-c", script, timeout=60)  # its limit and signal setting are its own
    path = tmp_path / "big.rows0.cols0.rank0.rows"
    message = run.stdout.strip()
    assert message.startswith(
        "BuilderError: disk tier: cannot reserve 64.5 KiB (512 bytes of it the write log) for "
        f"table 'big' (rank 0) file {str(path)!r} (File too large; "
    ), run.stdout + run.stderr
    assert message.endswith(
        " free there); free disk space, choose another DiskTier(directory=...), keep fewer "
        "tables on disk, or give DiskTier a smaller write_log="
    )
    assert not path.exists()
