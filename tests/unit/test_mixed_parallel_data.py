"""The mixed-parallel example's data: split over ranks, following its Markov chain, entropies.

Training and resharding the example on real processes is in
tests/e2e/test_mixed_parallel_example.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from example_modules import load_example

data = load_example(Path("mixed_parallel/data.py"), "mixed_parallel_data")


def test_data_is_split_over_ranks_and_follows_the_chain() -> None:
    text = data.MarkovText(vocab=8, seq_len=16, batch_size=12, eval_batch_size=6, seed=3)
    whole = text.sequences(5, 12)
    for world in (1, 2, 3):
        shares = [text.train(5, SimpleNamespace(rank=r, world_size=world)) for r in range(world)]
        assert torch.equal(torch.cat([inputs for inputs, _ in shares]), whole[:, :-1])
        assert torch.equal(torch.cat([targets for _, targets in shares]), whole[:, 1:])
    allowed = text.transition[whole[:, :-2], whole[:, 1:-1], whole[:, 2:]]
    assert bool((allowed > 0).all())  # every token is one of its pair's candidates
    assert not torch.equal(text.sequences(6, 12), whole)
    assert torch.equal(data.MarkovText(vocab=8, seq_len=16, seed=3).sequences(5, 12), whole)
    h = text.entropies()
    assert h.rate < h.best < h.first_order < h.unigram <= math.log(8)
    with pytest.raises(ValueError, match="multiple of the world size"):
        text.validation(0, SimpleNamespace(rank=0, world_size=4))
