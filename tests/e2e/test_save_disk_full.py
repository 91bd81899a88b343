"""A disk that fills up on one rank during a save (simulated with a file-size limit on rank 1,
SIGXFSZ ignored, so a write fails with EFBIG as it would with ENOSPC): every rank raises a
CheckpointError naming the cause, the rank and the file, and the previous checkpoint survives."""

from __future__ import annotations

import resource
import signal
from pathlib import Path

import pytest
import torch
from checkpoint_models import make_model, train
from faults import assert_first_checkpoint_intact

import manualpar as mp
from manualpar.testing import run_distributed

pytestmark = pytest.mark.timeout(120)

LIMIT = 1024  # bytes: far below rank 1's share of the tensors (DCP spreads them over the ranks)


def _save_with_a_file_size_limit(directory: str, asynchronous: bool) -> dict:
    """Commit ckpt_a (step 1), then save ckpt_b with rank 1 unable to write past LIMIT bytes."""
    strategy = mp.ManualParallelStrategy()
    model = make_model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optimizer, steps=1)
    state = {"model": model, "optim": optimizer, "step": 1}
    strategy.save_checkpoint(Path(directory) / "ckpt_a", state)
    big = {"model": make_model(seed=0, hidden=256), "step": 2}  # about 4 KiB per rank
    if strategy.rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )
    error = None
    try:
        if asynchronous:
            strategy.save_checkpoint_async(Path(directory) / "ckpt_b", big)
            strategy.wait_for_checkpoint()
        else:
            strategy.save_checkpoint(Path(directory) / "ckpt_b", big)
    except mp.ManualParError as caught:
        error = (type(caught).__name__, str(caught))
    strategy.teardown()
    return {"error": error}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "background"])
def test_a_full_disk_on_one_rank_names_the_cause_rank_and_file(
    asynchronous: bool, tmp_path: Path
) -> None:
    results = run_distributed(
        _save_with_a_file_size_limit, world_size=2, args=(str(tmp_path), asynchronous)
    )
    staging = tmp_path / ".ckpt_b.partial"
    for result in results:
        kind, message = result["error"]
        assert kind == "CheckpointError"
        assert message == (
            f"save_checkpoint({tmp_path / 'ckpt_b'}): writing tensor shards failed on rank 1: "
            f"file too large: could not write {staging / '__1_0.distcp'} ([Errno 27] File too "
            "large); raise the file-size limit (ulimit -f) or use a filesystem that allows "
            "larger files, or save elsewhere"
        ), message
    assert mp.latest_checkpoint(tmp_path) == tmp_path / "ckpt_a"
    assert not (tmp_path / "ckpt_b").exists()
    assert_first_checkpoint_intact(tmp_path)
