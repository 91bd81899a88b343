"""Dense builders with meshes in one process: the single-process path, and the errors for bad
meshes, bad tp plans and builders over the same parameters on meshes that do not compose."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from mesh_dense_cases import MLP, TP_PLAN, make_mlp
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

import manualpar as mp
from manualpar.ownership import owner_of


@pytest.fixture
def strategy() -> Iterator[mp.ManualParallelStrategy]:
    with mp.ManualParallelStrategy(accelerator="cpu") as strategy:
        yield strategy


def test_world_size_one_tp_then_fsdp_from_meta_equals_eager(
    strategy: mp.ManualParallelStrategy,
) -> None:
    mesh = strategy.mesh(dp=1, tp=1)
    torch.manual_seed(0)
    with mp.empty_init():
        model = MLP()
    assert mp.tp(model, strategy, mesh=mesh["tp"], plan=TP_PLAN) is model
    assert owner_of(model.fc1.weight) == "tp" and owner_of(model.head.weight) is None
    mp.fsdp(model, strategy, mesh=mesh["dp"])
    assert {owner_of(p) for p in model.parameters()} == {"fsdp"}
    for key, value in make_mlp().state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)
    hsdp = mp.fsdp(make_mlp(), strategy, mesh=strategy.mesh(replicate=1, shard=1))
    assert not any(p.is_meta for p in hsdp.parameters())


def test_bad_meshes(strategy: mp.ManualParallelStrategy) -> None:
    three = strategy.mesh(a=1, b=1, c=1)
    with pytest.raises(mp.BuilderError, match=r"fsdp\(\): takes a 1-D or 2-D mesh, got a 3-D"):
        mp.fsdp(make_mlp(), strategy, mesh=three)
    with pytest.raises(mp.BuilderError, match=r"tp\(\): takes a 1-D mesh, got a 3-D"):
        mp.tp(make_mlp(), strategy, mesh=three, plan=TP_PLAN)
    two = strategy.mesh(replicate=1, shard=1)
    with pytest.raises(mp.BuilderError, match=r"ddp\(\): takes a 1-D mesh, got a 2-D mesh"):
        mp.ddp(make_mlp(), strategy, mesh=two)
    with pytest.raises(mp.BuilderError, match=r"zero_optimizer\(\): takes a 1-D mesh"):
        mp.zero_optimizer(make_mlp().parameters(), torch.optim.SGD, strategy, mesh=two, lr=0.1)
    with pytest.raises(mp.BuilderError, match=r"tp\(\): mesh= is required"):
        mp.tp(make_mlp(), strategy, mesh=None, plan=TP_PLAN)  # type: ignore[arg-type]
    with pytest.raises(mp.BuilderError, match="expected a DeviceMesh"):
        mp.tp(make_mlp(), strategy, mesh="tp", plan=TP_PLAN)  # type: ignore[arg-type]


def test_bad_tp_plans(strategy: mp.ManualParallelStrategy) -> None:
    tp_mesh = strategy.mesh(dp=1, tp=1)["tp"]

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    with pytest.raises(
        mp.BuilderError,
        match=r"plan\['mlp'\] = 'colwise' needs an nn.Linear, but 'mlp' is a Sequential; plan "
        r"the nn.Linear layers inside it \(e.g. 'mlp.0'\)",
    ):
        mp.tp(Wrapped(), strategy, mesh=tp_mesh, plan={"mlp": "colwise"})
    with pytest.raises(
        mp.BuilderError,
        match=r"plan path 'fc3' is not a submodule of MLP; .* \(its nn.Linear layers: fc1, fc2",
    ):
        mp.tp(make_mlp(), strategy, mesh=tp_mesh, plan={"fc3": "rowwise"})
    with pytest.raises(mp.BuilderError, match=r"plan\['fc1'\] is 'column'; use 'colwise'"):
        mp.tp(make_mlp(), strategy, mesh=tp_mesh, plan={"fc1": "column"})  # type: ignore[dict-item]
    with pytest.raises(mp.BuilderError, match="plan must be a non-empty dict"):
        mp.tp(make_mlp(), strategy, mesh=tp_mesh, plan={})
    model = make_mlp()  # a ParallelStyle object is passed through; failed calls claimed nothing
    mp.tp(model, strategy, mesh=tp_mesh, plan={"fc1": ColwiseParallel(), "fc2": "rowwise"})
    assert owner_of(model.fc1.weight) == "tp"


def test_builders_over_tp_parameters_on_other_meshes(strategy: mp.ManualParallelStrategy) -> None:
    mesh = strategy.mesh(dp=1, tp=1)
    model = mp.tp(make_mlp(), strategy, mesh=mesh["tp"], plan=TP_PLAN)
    with pytest.raises(
        mp.BuilderError,
        match=r"ddp\(\): parameter 'fc1.weight' \(8, 6\) is sharded by tp\(\) over mesh \(tp=1\), "
        r"but ddp\(\) would replicate it over mesh \(dp=1\)",
    ):
        mp.ddp(model, strategy, mesh=mesh["dp"])
    with pytest.raises(
        mp.BuilderError, match=r"zero_optimizer\(\): parameter 0 \(8, 6\) is sharded by tp\(\)"
    ):
        mp.zero_optimizer(model.parameters(), torch.optim.SGD, strategy, lr=0.1)
    other = strategy.mesh(replicate=1, shard=1)
    for bad, label in [
        (mesh["tp"], r"mesh \(tp=1\)"),
        (other["shard"], r"mesh \(shard=1\)"),
        (None, "the strategy's whole group"),
    ]:
        with pytest.raises(
            mp.BuilderError,
            match=r"fsdp\(\): parameter 'fc1.weight' \(8, 6\) is sharded by tp\(\) over mesh "
            rf"\(tp=1\); fsdp\(\) over {label}.* cannot shard it further",
        ):
            mp.fsdp(model, strategy, mesh=bad)
    with pytest.raises(
        mp.BuilderError,
        match=r"tp\(\): parameter 'fc1.weight' .* already owned by tp\(\) on mesh \(tp=1\)",
    ):
        mp.tp(model, strategy, mesh=mesh["tp"], plan={"fc1": "colwise"})
    mp.fsdp(model, strategy, mesh=mesh["dp"])  # the composition is accepted
    with pytest.raises(mp.BuilderError, match=r"already owned by fsdp\(\) on mesh \(dp=1\)"):
        mp.tp(model, strategy, mesh=mesh["tp"], plan={"fc2": "rowwise"})


def test_one_module_on_two_meshes_names_both(strategy: mp.ManualParallelStrategy) -> None:
    first = strategy.mesh(replicate=1, shard=1)
    second = strategy.mesh(world=1)
    model = mp.fsdp(make_mlp(), strategy, mesh=first)
    with pytest.raises(
        mp.BuilderError,
        match=r"fsdp\(\): module MLP was already set up by fsdp\(\); .*\(fsdp\(\) ran on mesh "
        r"\(replicate=1, shard=1\), this fsdp\(\) call on mesh \(world=1\)",
    ):
        mp.fsdp(model, strategy, mesh=second)
    with pytest.raises(
        mp.BuilderError, match=r"ddp\(\): module MLP was already set up by fsdp\(\); .*world=1"
    ):
        mp.ddp(model, strategy, mesh=second)
