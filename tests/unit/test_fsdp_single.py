"""fsdp() on one process: it moves, materializes and claims; bad inputs raise before anything
changes. The multi-rank runs are in tests/dist/test_fsdp.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from fsdp_cases import DIM, Net, make_net
from torch import nn

import manualpar as mp
from manualpar.builders.fsdp import fsdp
from manualpar.ownership import owner_of


def test_single_process_moves_materializes_and_claims() -> None:
    strategy = mp.ManualParallelStrategy()
    model = fsdp(make_net(0, "meta"), strategy)  # on strategy.device, initialized on the CPU
    assert {p.device for p in model.parameters()} == {strategy.device}
    for key, value in make_net(0).state_dict().items():
        torch.testing.assert_close(model.state_dict()[key].cpu(), value, rtol=0, atol=0)
    assert {owner_of(p) for p in model.parameters()} == {"fsdp"}
    with pytest.raises(mp.BuilderError, match="already set up by fsdp"):
        fsdp(model, strategy)
    with pytest.warns(UserWarning, match="not sharded"):
        fsdp(make_net(0), strategy, param_dtype=torch.bfloat16)


def test_bad_inputs_raise_before_anything_changes() -> None:
    strategy = mp.ManualParallelStrategy()
    model = make_net(0, "meta")
    model.out = nn.Linear(DIM, 3)
    with pytest.raises(mp.BuilderError, match="on the meta device and 2 elsewhere"):
        fsdp(model, strategy)

    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        bare = nn.Sequential(nn.Linear(3, 3), NoReset())
    with pytest.raises(
        mp.BuilderError,
        match=r"^fsdp\(\): .* define no reset_parameters\(\): '1' \(NoReset: scale\)\. ",
    ):
        fsdp(bare, strategy)
    other = make_net(0)
    with pytest.raises(mp.BuilderError, match=r"item 0 \(Linear\) is not a submodule"):
        fsdp(make_net(0), strategy, wrap=[other.inp])
    with pytest.raises(mp.BuilderError, match="min_num_params must be positive"):
        fsdp(make_net(0), strategy, min_num_params=0)


def test_a_module_list_is_refused_with_how_to_shard_its_blocks() -> None:
    blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(
        mp.BuilderError, match=r"fsdp\(\): a ModuleList has no forward to shard around; shard each"
    ):
        mp.fsdp(blocks, mp.ManualParallelStrategy())


def test_per_rank_seeding_before_an_fsdp_init_warns_and_says_what_to_do() -> None:
    """Each rank would draw its slice of the parameters from its own stream, so the values
    would depend on the world size (world size 1 warns too, before a run on more ranks)."""
    strategy = mp.ManualParallelStrategy()
    strategy.seed_everything(0, per_rank=True)
    with mp.empty_init():
        net = Net()
    with pytest.warns(UserWarning) as record:
        fsdp(net, strategy)
    message = str(record[0].message)
    assert message.startswith(
        "fsdp(): torch's RNG is seeded per rank (seed_everything(0, per_rank=True): this rank "
        "drew from seed 0)"
    )
    assert (
        "Seed the same on every rank before setup (strategy.seed_everything(0)) and per rank "
        "after it" in message
    )
    assert record[0].filename == __file__  # points at the fsdp() call
    for seed in (lambda: torch.manual_seed(5), lambda: strategy.seed_everything(0)):
        strategy.seed_everything(0, per_rank=True)
        seed()  # the same seed on every rank, by manualpar or by torch: nothing to say
        with mp.empty_init():
            net = Net()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fsdp(net, strategy)
