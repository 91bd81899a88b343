"""Dense builders over device meshes on 4 ranks (2 nodes x 2): HSDP, FSDP x TP, ddp and zero
over one dim, each against a single-process plain-torch reference."""

from __future__ import annotations

import pytest
import torch
from mesh_dense_cases import ddp_reference, fsdp_tp, hsdp_ddp_zero, make_mlp, reference

from manualpar.testing import run_distributed

pytestmark = pytest.mark.timeout(240)

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, **TOL, msg=key)


def test_hsdp_and_ddp_zero_over_one_dim() -> None:
    results = run_distributed(hsdp_ddp_zero, world_size=4, local_world_size=2)
    want = reference(clip=False)
    eager = make_mlp().state_dict()
    for rank, got in enumerate(results):
        assert got["placements"] == {"(Replicate(), Shard(dim=0))"}
        _same_state(got["initial"], eager)  # meta init under HSDP == eager init
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
        _same_state(got["state"], want["state"])
        # mesh (replicate=2, shard=2) = [[0, 1], [2, 3]]: rank r replicates with r % 2 and r % 2 + 2
        row = ddp_reference([rank % 2, rank % 2 + 2])
        world = ddp_reference([0, 1, 2, 3])
        for key in ("rank_mean", "sample_mean", "zero_stepped"):
            for g, w in zip(got[key], row[key], strict=True):
                torch.testing.assert_close(g, w, **TOL)
        assert not torch.allclose(got["rank_mean"][0], world["rank_mean"][0])  # not the world's
        assert not torch.allclose(got["rank_mean"][0], got["sample_mean"][0])
        assert got["zero_group_size"] == 2


def test_fsdp_times_tp_matches_one_process() -> None:
    results = run_distributed(fsdp_tp, world_size=4, local_world_size=2)
    want = reference(clip=True)
    eager = make_mlp().state_dict()
    for got in results:
        assert got["placements"]["fc1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert got["placements"]["fc2.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert got["placements"]["head.weight"] == "(Shard(dim=0),)"
        _same_state(got["initial"], eager)  # meta init with tp + fsdp == eager init
        _same_state(got["tp_alone"], eager)  # and with tp alone
        _same_state(got["tp_eager"], eager)  # tp of a module built eagerly keeps its values
        assert got["tp_alone_local"] == (4, 6)
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)  # clip_grad_norm_ on 2-D
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
        _same_state(got["state"], want["state"])
        assert "mesh (tp=2)" in got["errors"]["fsdp_same_dim"]
        assert "sharded by tp() over mesh (tp=2)" in got["errors"]["ddp"]
        assert "whole group (world=4)" in got["errors"]["ddp"]
