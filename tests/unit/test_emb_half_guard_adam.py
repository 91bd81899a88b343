"""Adam's step bound for the half-row guard (step/adam_bounds.py): every update of the real rule
moves every element by at most the bound, under gradients built to reach it, lazy rows, tiny
and huge gradients and several betas; a loaded state it cannot bound reads as unbounded. The
guard's use of it: tests/unit/test_emb_half_guard_bounds.py."""

from __future__ import annotations

import math

import pytest
import torch

from manualpar.embeddings import Adam
from manualpar.embeddings.step.adam_bounds import AdamSteps

ROWS, DIM = 6, 5


def _gradients(kind: str, steps: int, betas: tuple[float, float]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    if kind == "worst":  # Cauchy-Schwarz's equality: grows by b2 / b1 an update, one sign
        growth = math.log(betas[1] / max(betas[0], 1e-3))  # (squares below float32's max)
        return [torch.full((ROWS, DIM), math.exp(min(k * growth, 41.0))) for k in range(steps)]
    if kind == "scales":  # every size from subnormal squares to 1e18, signs at random
        scales = 10.0 ** torch.randint(-40, 19, (steps,), generator=g).double()
        return [torch.randn(ROWS, DIM, generator=g) * float(s) for s in scales]
    big = [torch.randn(ROWS, DIM, generator=g) * 1e6 for _ in range(steps // 2)]
    return big + [torch.full((ROWS, DIM), 1e-25)] * (steps - steps // 2)  # then tiny


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.9), (0.0, 0.99), (0.95, 0.5)])
@pytest.mark.parametrize("kind", ["worst", "scales", "big_then_tiny"])
def test_no_adam_update_moves_an_element_past_its_bound(
    betas: tuple[float, float], kind: str
) -> None:
    rule, lr = Adam(lr=0.5, betas=betas), 0.5
    steps = AdamSteps.of(rule)
    assert steps is not None
    weight = torch.zeros(ROWS, DIM)
    state = rule.init_state(ROWS, DIM)
    assert steps.read(0, state) and steps.ratio[0] == 0.0
    taken = []
    for update, grad in enumerate(_gradients(kind, 120, betas), start=1):
        rows = torch.arange(ROWS) if update % 3 else torch.tensor([0, 2])  # lazy: some rows
        bound = steps.step(0, lr, update)
        steps.grow(0)
        before = weight.clone()
        rule.step_rows(weight, state, rows, grad[rows], update, None)
        moved = float((weight - before).abs().max())
        assert moved <= bound, (update, moved, bound)
        taken.append(moved / bound)
    if kind == "worst" and betas[0] ** 2 < betas[1]:  # the bound is reached, not just held
        assert max(taken) > 0.9
    # the ratio read again from the moments stays within the one carried along
    carried = steps.ratio[0]
    assert steps.read(0, state) and steps.ratio[0] <= carried


def test_moments_it_cannot_bound_read_as_unbounded() -> None:
    steps = AdamSteps.of(Adam(lr=1.0))
    assert steps is not None
    zeros = {"exp_avg": torch.zeros(3, 2), "exp_avg_sq": torch.zeros(3, 2)}
    assert steps.read(0, zeros) and steps.ratio[0] == 0.0
    for m, v in [(1.0, -1.0), (1.0, 0.0), (math.nan, 1.0), (0.0, math.nan), (0.0, -1e-30)]:
        state = {"exp_avg": torch.full((3, 2), m), "exp_avg_sq": torch.full((3, 2), v)}
        assert not steps.read(1, state), (m, v)
        assert steps.step(1, 1.0, 5) == math.inf
    state = {"exp_avg": torch.tensor([[3.0, -4.0]]), "exp_avg_sq": torch.tensor([[1.0, 4.0]])}
    assert steps.read(2, state) and steps.ratio[2] == pytest.approx(3.0)
    assert AdamSteps.of(Adam(lr=1.0, betas=(0.9, 0.0))) is None  # v forgets at once: none


@pytest.mark.parametrize("betas", [(0.95, 0.5), (0.9, 0.81), (0.9, 0.999)])
def test_a_loose_bound_read_again_still_holds_and_stays_small(betas: tuple[float, float]) -> None:
    """Where b1^2 >= b2 the carried C grows without limit; read again whenever it is `loose`
    (past twice the last read), every update still moves every element by at most the bound,
    and C stays near the moments' real ratio. Under the default betas it is never loose."""
    rule, lr = Adam(lr=0.5, betas=betas), 0.5
    steps = AdamSteps.of(rule)
    assert steps is not None
    weight, state = torch.zeros(ROWS, DIM), rule.init_state(ROWS, DIM)
    assert steps.read(0, state)
    reads, g = 0, torch.Generator().manual_seed(3)
    for update in range(1, 121):
        if steps.loose(0):
            reads += 1
            assert steps.read(0, state)
        rows = torch.arange(ROWS) if update % 3 else torch.tensor([0, 2])
        bound = steps.step(0, lr, update)
        steps.grow(0)
        before = weight.clone()
        grad = torch.randn(len(rows), DIM, generator=g) * float(10.0 ** (update % 7 - 3))
        rule.step_rows(weight, state, rows, grad, update, None)
        assert float((weight - before).abs().max()) <= bound, update
    assert (reads == 0) == (betas[0] ** 2 < betas[1])
    assert steps.ratio[0] < 100  # carried alone, (0.95, 0.5) reaches about 3e15 by now
