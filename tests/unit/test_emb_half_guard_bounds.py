"""The half-row guard on one process: on by default for half tables, free while the bounds rule
an overflow out (nothing copied), exact when they cannot (step/half_bounds.py,
step/half_overflow.py). Refusals over ranks: tests/dist/test_emb_step_half_overflow_ranks.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    Adagrad,
    Adam,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    SparseFeatures,
    UpdateRule,
    shard_embeddings,
)
from manualpar.embeddings.step import half_overflow
from manualpar.errors import NonFiniteError

BATCH = SparseFeatures.from_dict({"user": [[1, 2], [3], [1]]})


def _build(
    rule: UpdateRule, dtype: torch.dtype = torch.float16, fill: float | None = None, **options: Any
) -> Any:
    ebc = EmbeddingBagCollection([EmbeddingBagConfig("user", 10, 4, dtype=dtype)], seed=3)
    if fill is not None:
        with torch.no_grad():
            ebc.tables["user"].weight.fill_(fill)
    return shard_embeddings(ebc, mp.ManualParallelStrategy(), "auto", rule, **options)


def _step(emb: Any, up: float = 1.0) -> None:
    """One training step whose gradient moves every looked-up value up (`up` > 0)."""
    (-up * emb(BATCH).values.sum()).backward()


def _rows(emb: Any) -> torch.Tensor:
    return emb.tables["user"].weight.detach().clone()


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many steps copied their rows aside (the guard's slow path)."""
    counted: list[int] = []
    save: Callable[..., Any] = half_overflow.save_rows

    def counting(*args: Any, **kwargs: Any) -> Any:
        counted.append(1)
        return save(*args, **kwargs)

    monkeypatch.setattr(half_overflow, "save_rows", counting)
    return counted


@pytest.mark.parametrize(
    "rule", [RowWiseAdagrad(lr=1e4), Adagrad(lr=1e4), SGD(lr=1e4), Adam(lr=1e4)]
)
def test_half_tables_are_guarded_by_default(rule: UpdateRule) -> None:
    """Without being asked: an update that would overflow float16 rows is refused, every row
    and accumulator as before (before the default turned on, the rows became inf)."""
    emb = _build(rule, fill=60000.0)
    rows = _rows(emb)
    state = {k: v.clone() for k, v in emb.fused_optimizer.table_state["user"].items()}
    expected = r"update 1: 3 half-precision rows overflowed .* \(by table: 'user': 3\) on rank 0"
    with pytest.raises(NonFiniteError, match=expected):
        _step(emb)
    assert torch.equal(_rows(emb), rows)
    for key, value in emb.fused_optimizer.table_state["user"].items():
        assert torch.equal(value, state[key]), key
    assert emb.fused_optimizer.num_updates == 0


def test_guard_half_rows_false_opts_out() -> None:
    """The explicit opt-out: nothing checked, the overflow reaches the rows."""
    emb = _build(RowWiseAdagrad(lr=1e4), fill=60000.0, guard_half_rows=False)
    _step(emb)
    assert torch.isinf(_rows(emb)[1:4]).all()


@pytest.mark.parametrize(
    "rule", [RowWiseAdagrad(lr=0.1), Adagrad(lr=0.1), SGD(lr=0.1), Adam(lr=0.1)]
)
def test_a_step_the_bounds_rule_out_copies_nothing(rule: UpdateRule, copies: list[int]) -> None:
    """The usual step: no row is copied aside, and the tables train to the bits of an
    unguarded run."""
    guarded, unguarded = _build(rule), _build(rule, guard_half_rows=False)
    for _ in range(4):
        _step(guarded)
        _step(unguarded)
    assert copies == []
    assert torch.equal(_rows(guarded), _rows(unguarded))


def test_rows_loaded_near_the_limit_are_read_again(copies: list[int]) -> None:
    """The bounds hold for the rows the update wrote; a load writes others, which the next
    step reads (torch's version counter moved) before trusting its bound."""
    emb = _build(RowWiseAdagrad(lr=1e4))
    emb.fused_optimizer.lr = 0.1
    _step(emb)
    assert copies == []
    emb.load_state_dict({"tables.user.weight": torch.full((10, 4), 60000.0)})
    emb.fused_optimizer.lr = 1e4
    with pytest.raises(NonFiniteError, match="overflowed"):
        _step(emb)
    assert copies == [1]
    assert torch.equal(_rows(emb), torch.full((10, 4), 60000.0, dtype=torch.float16))


def test_sgd_is_bounded_by_its_gradient(copies: list[int]) -> None:
    """SGD's step is the gradient's size: a gradient large enough to overflow is refused."""
    emb = _build(SGD(lr=1.0), fill=1.0)
    _step(emb, up=10.0)
    assert copies == []
    with pytest.raises(NonFiniteError, match="overflowed"):
        _step(emb, up=1e5)
    assert copies == [1]


def test_bfloat16_rows_are_guarded_at_their_own_limit(copies: list[int]) -> None:
    """bfloat16 holds values up to 3.39e38: a float16-sized step is ruled out at once."""
    emb = _build(RowWiseAdagrad(lr=1e5), dtype=torch.bfloat16, fill=60000.0)
    _step(emb)
    assert copies == []
    emb.fused_optimizer.lr = 1e38
    emb.load_state_dict({"tables.user.weight": torch.full((10, 4), 3.3e38)})
    with pytest.raises(NonFiniteError, match="overflowed"):
        _step(emb)


def test_adam_without_a_second_moment_is_guarded_only_when_asked() -> None:
    """Adam with b2 = 0 has no step bound (v forgets at once, m does not; adam_bounds.py):
    guarding it copies every step, so the default leaves it off and `guard_half_rows=True`
    turns it on. With b2 > 0 it is bounded and guarded by default (above)."""
    rule = Adam(lr=1e4, betas=(0.9, 0.0))
    unguarded = _build(rule, fill=60000.0)
    assert unguarded.step.backward_phases.half_rows is None
    guarded = _build(rule, fill=60000.0, guard_half_rows=True)
    with pytest.raises(NonFiniteError, match="overflowed"):
        _step(guarded)


@pytest.mark.parametrize("rule_type", [RowWiseAdagrad, Adagrad, SGD, Adam])
def test_no_step_near_the_limit_overflows_unseen(
    rule_type: type[UpdateRule], copies: list[int]
) -> None:
    """Rows up to the limit and learning rates around it: every update either keeps every row
    finite or is refused (counted under "skip") with the rows as they were; some are ruled
    out by the bounds (nothing copied), some are not."""
    g = torch.Generator().manual_seed(5)
    for trial in range(24):  # rows near the limit, or small rows and steps up to past it
        size, lr = (60000.0, 5000.0) if trial % 2 else (1000.0, 70000.0)
        rows = (torch.rand(10, 4, generator=g) * 2 - 1) * size
        rows[1:4] += rows[1:4].sign() * (65504 - size) * float(trial % 2)
        emb = _build(rule_type(lr=float(torch.rand(1, generator=g)) * lr), non_finite="skip")
        emb.load_state_dict({"tables.user.weight": rows})
        before = _rows(emb)
        _step(emb, up=float(torch.randn(1, generator=g)))
        after = _rows(emb)
        if emb.skipped_updates:
            assert torch.equal(after, before), trial
        else:
            assert torch.isfinite(after).all(), trial
    assert 0 < len(copies) < 24


def test_adam_moments_written_by_hand_are_read_again(copies: list[int]) -> None:
    """Adam's bound carries its moments' ratio through the updates; moments written other than
    by an update (torch's version counter moved) are read again, and moments it cannot bound
    (m without v) send the step down the copy path."""
    emb = _build(Adam(lr=0.1))
    for _ in range(3):
        _step(emb)
    assert copies == []
    state = emb.fused_optimizer.table_state["user"]
    state["exp_avg"].fill_(1.0)
    state["exp_avg_sq"].zero_()
    _step(emb)
    assert copies == [1]


def test_adam_with_b1_squared_past_b2_reads_its_moments_again_instead_of_copying(
    copies: list[int],
) -> None:
    """b1^2 >= b2: the moments' bound grows by sqrt(b1^2 / b2) an update whatever they hold
    (adam_bounds.py), past float16's headroom after about 35 updates here, while their real
    ratio stays near 1: read again, it is small and no step copies (before, every step from
    then on copied). The rows train to the bits of an unguarded run."""
    rule = Adam(lr=1.0, betas=(0.95, 0.5))
    guarded, unguarded = _build(rule), _build(rule, guard_half_rows=False)
    for _ in range(60):
        _step(guarded)
        _step(unguarded)
    assert copies == []
    bounds = guarded.step.backward_phases.half_rows.bounds
    assert bounds.adam.ratio[0] < 1e3  # grown without the reads: about 4e6
    assert torch.equal(_rows(guarded), _rows(unguarded)) and torch.isfinite(_rows(guarded)).all()
