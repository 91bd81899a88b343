"""The fused optimizer as a torch Optimizer on one process: what schedulers see and set, what
step/zero_grad do, the scheduler-order warning, its checkpoint format, clipping settings and a
frozen collection. On 2 ranks against the reference:
tests/dist/test_emb_optim_fused_optimizer_ranks.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from embedding_cases import SEED, TABLES, local_loss, make_batch
from torch.optim import lr_scheduler

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    Adagrad,
    EmbeddingBagCollection,
    RowWiseAdagrad,
    ShardedEmbeddingBagCollection,
    shard_embeddings,
)

NAMES = [t.name for t in TABLES]


def sharded(rule=None) -> ShardedEmbeddingBagCollection:
    return shard_embeddings(
        EmbeddingBagCollection(TABLES, seed=SEED),
        mp.ManualParallelStrategy(),
        "auto",
        rule or SGD(lr=0.5),
    )


def train_step(emb: ShardedEmbeddingBagCollection, step: int) -> None:
    local_loss(emb(make_batch(0, step, 4)).values, 0, step).backward()


def weights(emb: ShardedEmbeddingBagCollection) -> dict[str, torch.Tensor]:
    return {name: emb.tables[name].weight.detach().clone() for name in NAMES}


def test_it_is_a_torch_optimizer_with_one_group_of_the_tables():
    emb = sharded()
    optimizer = emb.fused_optimizer
    assert isinstance(optimizer, torch.optim.Optimizer)
    (group,) = optimizer.param_groups
    assert group["param_names"] == NAMES
    assert all(p is emb.tables[n].weight for p, n in zip(group["params"], NAMES, strict=True))
    assert group["lr"] == optimizer.lr == 0.5
    assert optimizer.state[emb.tables["t0"].weight] is optimizer.table_state["t0"]
    with pytest.raises(mp.BuilderError, match="FusedOptimizer has one param group"):
        optimizer.add_param_group({"params": [torch.zeros(1, requires_grad=True)]})


@pytest.mark.parametrize(
    "make",
    [
        lambda o: lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        lambda o: lr_scheduler.LambdaLR(o, lambda s: 0.9**s),
        lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=3),
        lambda o: lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=4, cycle_momentum=False),
        lambda o: lr_scheduler.SequentialLR(
            o,
            [lr_scheduler.ConstantLR(o, 0.5, total_iters=1), lr_scheduler.ExponentialLR(o, 0.8)],
            milestones=[1],
        ),
    ],
    ids=["step", "lambda", "cosine", "onecycle", "sequential"],
)
def test_each_backward_applies_the_lr_the_scheduler_set_without_a_warning(make):
    """The lrs the update reads are those the same scheduler gives a plain torch SGD; stepping
    the scheduler after each backward, with no optimizer.step(), warns of nothing."""
    emb = sharded()
    plain = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    schedule, plain_schedule = make(emb.fused_optimizer), make(plain)
    seen, expected = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            train_step(emb, step)
            seen.append(emb.fused_optimizer.rule.lr)
            expected.append(plain.param_groups[0]["lr"])
            schedule.step()
            plain.step()
            plain_schedule.step()
    assert seen == expected and len(set(seen)) > 1
    assert emb.fused_optimizer.param_groups[0]["initial_lr"] == plain.param_groups[0]["initial_lr"]


def test_a_scheduler_stepped_before_any_backward_still_warns():
    """That warning is real: the schedule's first lr would never be applied."""
    emb = sharded()
    schedule = lr_scheduler.StepLR(emb.fused_optimizer, step_size=1)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        schedule.step()


def test_step_updates_nothing_and_zero_grad_clears_nothing():
    emb = sharded()
    before = weights(emb)
    assert emb.fused_optimizer.step() is None
    emb.fused_optimizer.zero_grad()
    assert all(torch.equal(before[n], w) for n, w in weights(emb).items())
    assert emb.fused_optimizer.num_updates == 0

    def closure() -> float:
        loss = local_loss(emb(make_batch(0, 0, 4)).values, 0, 0)
        loss.backward()  # the update happens here, once
        return float(loss.detach())

    loss = emb.fused_optimizer.step(closure)
    assert isinstance(loss, float) and emb.fused_optimizer.num_updates == 1
    assert not torch.equal(before["t0"], emb.tables["t0"].weight)
    assert all(emb.tables[n].weight.grad is None for n in NAMES)


def test_an_lr_set_by_hand_or_in_the_group_is_read_at_the_next_backward():
    emb = sharded()
    emb.fused_optimizer.param_groups[0]["lr"] = torch.tensor(0.25)  # torch allows tensor lrs
    train_step(emb, 0)
    assert emb.fused_optimizer.rule.lr == 0.25
    emb.fused_optimizer.lr = 0.125
    assert emb.fused_optimizer.param_groups[0]["lr"] == 0.125
    train_step(emb, 1)
    assert emb.fused_optimizer.rule.lr == 0.125


def test_a_bad_lr_in_the_group_stops_the_backward_before_any_update():
    emb = sharded()
    before = weights(emb)
    emb.fused_optimizer.param_groups[0]["lr"] = -0.1
    pooled = emb(make_batch(0, 0, 4)).values
    with pytest.raises(
        mp.BuilderError,
        match=r"^fused optimizer: param_groups\[0\]\['lr'\] \(set by a scheduler or by hand\): "
        r"lr must be a finite number >= 0, got -0.1$",
    ):
        local_loss(pooled, 0, 0).backward()
    assert all(torch.equal(before[n], w) for n, w in weights(emb).items())


def test_checkpoint_format_is_unchanged_and_the_scheduler_saves_beside_it(tmp_path: Path):
    """The state dict keeps its keys ("lr", "step", "state"), is saved as a stateful entry
    (not as a torch optimizer), and a scheduler in the same checkpoint resumes its schedule."""
    strategy = mp.ManualParallelStrategy()
    emb = sharded(Adagrad(lr=0.3))
    schedule = lr_scheduler.StepLR(emb.fused_optimizer, step_size=1, gamma=0.5)
    for step in range(2):
        train_step(emb, step)
        schedule.step()
    assert set(emb.fused_optimizer.state_dict()) == {"lr", "step", "state"}
    path = tmp_path / "ckpt"
    strategy.save_checkpoint(
        path, {"model": emb, "sparse_optim": emb.fused_optimizer, "s": schedule}
    )
    assert mp.read_manifest(path)["entries"]["sparse_optim"] == "stateful"

    fresh = sharded(Adagrad(lr=0.3))
    fresh_schedule = lr_scheduler.StepLR(fresh.fused_optimizer, step_size=1, gamma=0.5)
    state = {"model": fresh, "sparse_optim": fresh.fused_optimizer, "s": fresh_schedule}
    strategy.load_checkpoint(path, state)
    assert fresh.fused_optimizer.lr == 0.075 and fresh.fused_optimizer.num_updates == 2
    fresh_schedule.step()
    schedule.step()
    assert fresh.fused_optimizer.lr == emb.fused_optimizer.lr == 0.0375


def test_a_state_dict_written_before_the_optimizer_was_a_torch_optimizer_loads():
    """The plain dict format of earlier versions: lr, step count, per-table state."""
    emb = sharded(RowWiseAdagrad(lr=0.3))
    old = {
        "lr": 0.2,
        "step": 7,
        "state": {t.name: {"sum": torch.full((t.num_embeddings,), 0.5)} for t in TABLES},
    }
    emb.fused_optimizer.load_state_dict(old)
    assert emb.fused_optimizer.lr == 0.2 and emb.fused_optimizer.num_updates == 7
    assert torch.equal(emb.fused_optimizer.table_state["t4"]["sum"], old["state"]["t4"]["sum"])


# ---- clipping settings ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: SGD(lr=0.1, max_grad_norm=0),
            "SGD: max_grad_norm must be a finite number > 0 (or None: no clipping), got 0",
        ),
        (
            lambda: RowWiseAdagrad(lr=0.1, max_row_grad_norm=float("inf")),
            "RowWiseAdagrad: max_row_grad_norm must be a finite number > 0 (or None: no "
            "clipping), got inf",
        ),
    ],
    ids=["zero_global", "infinite_row"],
)
def test_bad_clipping_settings(make, message: str) -> None:
    with pytest.raises(mp.BuilderError) as error:
        make()
    assert str(error.value) == message


def test_clipping_is_keyword_only_and_described():
    assert Adagrad(0.1, 1e-8).eps == 1e-8  # positional fields keep their order
    rule = RowWiseAdagrad(lr=0.1, max_row_grad_norm=1.0, max_grad_norm=5.0)
    assert rule.describe() == "RowWiseAdagrad(lr=0.1, max_row_grad_norm=1.0, max_grad_norm=5.0)"
    emb = sharded(rule)
    assert not emb.fused_optimizer.fuses_bags and emb.fused_optimizer.needs_full_rows


# ---- frozen ------------------------------------------------------------------------------------
def test_a_frozen_collection_has_no_backward_and_unfreezes():
    emb = sharded()
    before = weights(emb)
    emb.requires_grad_(False)
    assert not emb(make_batch(0, 0, 4)).values.requires_grad
    assert emb.fused_optimizer.num_updates == 0
    emb.requires_grad_(True)
    train_step(emb, 0)
    assert emb.fused_optimizer.num_updates == 1
    assert not torch.equal(before["t0"], emb.tables["t0"].weight)


def test_a_table_frozen_before_sharding_stays_frozen():
    with mp.empty_init():
        ebc = EmbeddingBagCollection(TABLES, seed=SEED)
    ebc.tables["t2"].weight.requires_grad_(False)
    emb = shard_embeddings(ebc, mp.ManualParallelStrategy(), "auto", SGD(lr=0.5))
    assert [n for n in NAMES if not emb.tables[n].weight.requires_grad] == ["t2"]
    before = weights(emb)
    train_step(emb, 0)
    after = weights(emb)
    assert [n for n in NAMES if torch.equal(before[n], after[n])] == ["t2"]
