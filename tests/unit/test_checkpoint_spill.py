"""A background save's copy of a disk table (checkpoint/spill.py): each block's copy is a
storage of its own over its part of the file, so DCP's writer thread writes it as it is. A
view of a larger storage is cloned by DCP's writer, an 8 MiB heap copy per chunk made on the
writer thread under the step's malloc thresholds (heap.py), and those stayed mapped."""

from __future__ import annotations

from pathlib import Path

import torch

from manualpar.checkpoint.local_shards import Block
from manualpar.checkpoint.spill import spill_blocks


def test_each_spilled_copy_has_a_storage_of_its_own(tmp_path: Path) -> None:
    sources = [torch.randn(300, 8), torch.randn(5, 8), torch.arange(24, dtype=torch.int64)]
    blocks = [Block((i * 300, 0), t, spill_dir=tmp_path) for i, t in enumerate(sources)]
    copies = spill_blocks(blocks, tmp_path)
    assert list(tmp_path.iterdir()) == []  # the file has no name
    for source, copy in zip(sources, copies, strict=True):
        assert torch.equal(copy.tensor, source) and copy.tensor.dtype == source.dtype
        # what DCP's writer checks before it clones (filesystem._SerialCpuLoader)
        storage_bytes = copy.tensor.untyped_storage().nbytes()
        assert storage_bytes == copy.tensor.nbytes
        assert copy.prepare is not None
    pointers = [c.tensor.data_ptr() for c in copies]
    assert pointers[1] - pointers[0] == sources[0].nbytes  # one file, one part after another
    source_before = sources[0].clone()
    copies[0].tensor.add_(1)  # a copy, not the block itself
    assert torch.equal(sources[0], source_before)
