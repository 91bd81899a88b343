"""Trainer.predict on 2 ranks: every rank gets each global batch's scores in input order, bit
for bit those of one process and those validation_step computes, the uneven last batch
included."""

from __future__ import annotations

from pathlib import Path

import torch
from predict_cases import score

from manualpar.testing import run_distributed


def test_two_ranks_score_like_one_process_and_like_validation(tmp_path: Path) -> None:
    (alone,) = run_distributed(score, world_size=1, args=(str(tmp_path / "one"),))
    ranks = run_distributed(score, world_size=2, args=(str(tmp_path / "two"),))
    assert [len(s) for s in alone["scores"]] == [4, 4, 3]
    for rank in ranks:
        assert rank["batches"] == 3 and rank["ran_out"] == {} and rank["training"]
        for mine, one in zip(rank["scores"], alone["scores"], strict=True):
            assert torch.equal(mine, one)  # same order, same bits, on every rank
        # rank r's validation saw samples r, r + 2, ... of each global batch
        for seen, scores in zip(rank["seen"], alone["scores"], strict=True):
            assert torch.equal(seen, scores[rank["rank"] :: 2])
    assert torch.equal(torch.cat(alone["seen"]), torch.cat(alone["scores"]))
