"""ParallelModule: setup runs once, leaves nothing on meta, optimizers made too early fail, and
an optimizer over the self-updating tables warns."""

from __future__ import annotations

import re
import typing
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import manualpar as mp
import manualpar.module as module
from manualpar.embeddings import SGD as SparseSGD
from manualpar.errors import BuilderError
from manualpar.module import ParallelModule, check_optimizer
from manualpar.ownership import claim, mark_replaced


class TwoTowers(ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = nn.Linear(3, 3)
        self.dense = nn.Linear(3, 1)

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        claim(self.sparse, "fused_tables", trains_itself=True)  # updated inside backward
        claim(self.dense, "ddp")


def test_setup_runs_once_and_groups_parameters_by_owner() -> None:
    model = TwoTowers()
    strategy = mp.ManualParallelStrategy()
    with pytest.raises(BuilderError, match=r"TwoTowers\.dense_parameters\(\) called before setup"):
        model.dense_parameters()
    model.setup(strategy)
    assert model.strategy is strategy
    assert [p.shape for p in model.dense_parameters()] == [(1, 3), (1,)]
    by_owner = model.parameters_by_owner()
    assert sorted(by_owner, key=str) == ["ddp", "fused_tables"]
    with pytest.raises(BuilderError, match=r"TwoTowers\.setup\(\) already ran"):
        model.setup(strategy)


def test_builder_claims_a_module_once() -> None:
    layer = nn.Linear(2, 2)
    claim(layer, "ddp")
    with pytest.raises(BuilderError, match=r"fsdp\(\): module Linear was already set up by ddp"):
        claim(layer, "fsdp")


class ForgetsOnePart(ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.kept = nn.Linear(2, 2)
        self.real = nn.Linear(2, 2)

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        pass


def test_parameters_left_on_meta_after_setup_are_named() -> None:
    with pytest.raises(
        BuilderError,
        match=r"after ForgetsOnePart\.setup\(\) these are still on "
        r"the meta device: kept\.weight, kept\.bias\. Wrap them",
    ):
        ForgetsOnePart().setup(mp.ManualParallelStrategy())


def test_optimizer_made_before_setup_fails_at_its_first_step() -> None:
    model = nn.Linear(4, 2)
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    mark_replaced(model.parameters(), "fsdp")  # what fsdp() does to the pre-sharding parameters
    model.weight.grad = torch.zeros_like(model.weight)
    with pytest.raises(
        BuilderError,
        match=r"SGD holds a parameter of shape \(2, 4\) \(param group "
        r"0\) that was replaced by fsdp\(\).*created before model\.setup",
    ):
        early.step()


def test_optimizer_over_meta_parameters_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(BuilderError, match="is still on the meta device"):
        check_optimizer(optimizer)


class Tower(ParallelModule):
    """Built on meta; setup materializes it (new parameters replace the meta ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        mp.materialize(self, strategy)


def test_the_step_hook_refuses_an_early_optimizer_and_checks_a_good_one_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked: list[torch.optim.Optimizer] = []

    def counting_check(optimizer: torch.optim.Optimizer) -> None:
        checked.append(optimizer)
        check_optimizer(optimizer)

    monkeypatch.setattr(module, "check_optimizer", counting_check)
    with mp.empty_init():
        model = Tower()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    mp.materialize(model, mp.ManualParallelStrategy())  # without setup: only the hook sees it
    message = re.escape(
        "SGD holds a parameter of shape (2, 4) (param group 0) that is still on the meta "
        "device: the optimizer was created before model.setup(strategy). Create it after "
        "setup, e.g. torch.optim.Adam(model.dense_parameters())"
    )
    for _ in range(2):  # refused at every step, not only the first
        with pytest.raises(BuilderError, match=message):
            early.step()
    assert checked == [early, early]

    late = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        late.zero_grad()
        model.body(torch.ones(1, 4)).sum().backward()
        late.step()
    assert checked == [early, early, late], "a good optimizer is checked at its first step only"


class Regressor(ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        mp.materialize(self, strategy)


def test_load_trained_builds_on_meta_sets_up_and_loads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    strategy = mp.ManualParallelStrategy()
    trained = Regressor()
    trained.setup(strategy)
    optimizer = torch.optim.Adam(trained.dense_parameters())
    strategy.save_checkpoint(tmp_path / "ckpt", {"model": trained, "optim": optimizer, "step": 3})
    loaded = mp.load_trained(Regressor, strategy, tmp_path / "ckpt")
    typing.assert_type(loaded, Regressor)  # the built type, to a type checker (no isinstance)
    assert type(loaded) is Regressor and loaded.is_setup
    for a, b in zip(loaded.parameters(), trained.parameters(), strict=True):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0)  # b was built eagerly on CPU
    with pytest.raises(mp.CheckpointMismatchError, match="missing from the checkpoint: net"):
        mp.load_trained(Regressor, strategy, tmp_path / "ckpt", key="net")


def test_load_trained_returns_the_type_its_build_returns() -> None:
    hints = typing.get_type_hints(
        mp.load_trained, localns={"ManualParallelStrategy": mp.ManualParallelStrategy}
    )
    built = hints["return"]  # a type checker infers load_trained(Regressor, ...): Regressor
    assert isinstance(built, typing.TypeVar) and built.__bound__ is ParallelModule
    assert hints["build"] == Callable[[], built]


class _Tower(ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        mp.materialize(self.fc, strategy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_forward_before_setup_on_meta_names_the_model_and_the_fix() -> None:
    with mp.empty_init():
        model = _Tower()
    with pytest.raises(BuilderError) as caught:
        model(torch.ones(1, 3))
    assert str(caught.value) == (
        "_Tower.forward() called before setup(strategy): 'fc.weight' is still on the meta "
        "device (the model was built under empty_init()); call model.setup(strategy) first"
    )
    model.setup(mp.ManualParallelStrategy())
    assert model(torch.ones(1, 3)).shape == (1, 2)


def test_setup_refuses_an_optimizer_created_before_it_before_any_update() -> None:
    with mp.empty_init():
        model = Tower()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        BuilderError,
        match=re.escape(
            "an optimizer (param group with lr=0.1) holds a parameter of shape (2, 4) that is "
            "still on the meta device: the optimizer was created before model.setup(strategy). "
            "Create it after setup, e.g. torch.optim.Adam(model.dense_parameters()) (found at "
            "the end of Tower.setup(), before any update)"
        ),
    ):
        model.setup(mp.ManualParallelStrategy())
    del early
    fresh = Tower()
    fresh.setup(mp.ManualParallelStrategy())  # no optimizer yet: nothing to refuse
    torch.optim.SGD(fresh.parameters(), lr=0.1).step()


class Ranker(ParallelModule):
    """Sharded tables (updated by their fused optimizer in backward) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.sparse = mp.EmbeddingBagCollection([mp.EmbeddingBagConfig("item", 10, 4)])
        self.head = nn.Linear(4, 1)

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.sparse = mp.shard_embeddings(self.sparse, strategy, "auto", SparseSGD(lr=0.1))

    def loss(self) -> torch.Tensor:
        ids = mp.SparseFeatures.from_dict({"item": [[1, 2], [3]]})
        return self.head(self.sparse(ids).values).pow(2).mean()


SELF_TRAINED_WARNING = (
    "AdamW holds 1 parameter(s) (shapes (10, 4)) that shard_embeddings() updates itself in "
    "backward: they never get a gradient, so this optimizer's weight decay, learning rate and "
    "other param-group settings do not apply to them. Create the optimizer over "
    "model.dense_parameters() instead of model.parameters()"
)


@pytest.mark.parametrize("over", ["parameters", "dense_parameters"])
def test_an_optimizer_over_self_trained_tables_warns_once(over: str) -> None:
    model = Ranker()
    model.setup(mp.ManualParallelStrategy())
    optimizer = torch.optim.AdamW(getattr(model, over)(), lr=0.01, weight_decay=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad()
            model.loss().backward()
            optimizer.step()
    messages = [str(w.message) for w in caught]
    assert messages == ([SELF_TRAINED_WARNING] if over == "parameters" else [])


def test_setup_scans_for_early_optimizers_only_when_something_holds_a_replaced_parameter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scan visits every object of the process (0.2 s with torch loaded): a setup whose
    replaced parameters nothing else holds skips it, and an early optimizer is still found."""
    scans: list[int] = []
    original = module.gc.get_referrers

    def counting(*objects: object) -> list[object]:
        scans.append(len(objects))
        return original(*objects)

    monkeypatch.setattr(module.gc, "get_referrers", counting)
    with mp.empty_init():
        quiet = Tower()
    quiet.setup(mp.ManualParallelStrategy())
    assert scans == []
    with mp.empty_init():
        model = Tower()
    held = [next(iter(model.parameters()))]  # held elsewhere: scanned, nothing refused
    model.setup(mp.ManualParallelStrategy())
    assert scans == [2, 3]  # the replaced weight and bias; then `before`, `stale` and `held`
    with mp.empty_init():
        early = Tower()
    optimizer = torch.optim.SGD(early.parameters(), lr=0.1)
    with pytest.raises(
        BuilderError, match=re.escape("optimizer was created before model.setup(strategy)")
    ):
        early.setup(mp.ManualParallelStrategy())
    del held, optimizer


def test_the_fused_optimizer_itself_does_not_warn_about_the_tables_it_updates() -> None:
    """Its param group holds the tables it updates in backward: its `step()` (a closure's loop,
    a training loop stepping every optimizer) set off the warning meant for a user's optimizer
    over model.parameters(), which still warns."""
    model = Ranker()
    model.setup(mp.ManualParallelStrategy())
    fused = model.sparse.fused_optimizer

    def closure() -> torch.Tensor:
        loss = model.loss()
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused.step(closure)
        fused.step()
        torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1).step()
    assert [str(w.message) for w in caught] == [SELF_TRAINED_WARNING]
