"""manualpar.nn.CrossNet against DCN-v2's formula written out, in float64."""

from __future__ import annotations

import pytest
import torch

import manualpar as mp
from manualpar.nn import CrossNet


def _written_out(x0: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor]):
    """x_{l+1} = x_0 * (W_l x_l + b_l) + x_l, one sample and one output feature at a time."""
    rows = []
    for sample in x0:
        x = sample.clone()
        for w, b in zip(weights, biases, strict=True):
            mixed = torch.stack([sum(w[o, i] * x[i] for i in range(len(x))) for o in range(len(x))])
            x = sample * (mixed + b) + x
        rows.append(x)
    return torch.stack(rows)


def _random_(net: CrossNet, seed: int) -> None:
    """Non-zero biases too (reset_parameters leaves them 0, which would hide a missing b_l)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)


def test_full_rank_layers_follow_the_formula() -> None:
    net = CrossNet(5, 3, dtype=torch.float64)
    _random_(net, 0)
    x0 = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = _written_out(x0, list(net.weight), list(net.bias))
    torch.testing.assert_close(net(x0), expected, rtol=1e-12, atol=1e-12)


def test_low_rank_equals_full_rank_with_w_equal_u_v_transposed() -> None:
    low = CrossNet(6, 2, rank=2, dtype=torch.float64)
    _random_(low, 2)
    full = CrossNet(6, 2, dtype=torch.float64)
    with torch.no_grad():
        full.weight.copy_(low.u @ low.v.transpose(1, 2))  # W_l = U_l V_l^T, layer by layer
        full.bias.copy_(low.bias)
    x0 = torch.randn(7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(low(x0), full(x0), rtol=1e-12, atol=1e-12)
    expected = _written_out(x0, list(full.weight), list(low.bias))
    torch.testing.assert_close(low(x0), expected, rtol=1e-12, atol=1e-12)
    assert sum(p.numel() for p in low.parameters()) == 2 * (2 * 6 * 2 + 6)


def test_reset_parameters_xavier_per_layer_zero_bias_and_parameter_shapes() -> None:
    torch.manual_seed(0)
    net = CrossNet(64, 3, rank=8)
    assert net.weight is None and net.u.shape == net.v.shape == (3, 64, 8)
    assert [name for name, _ in net.named_parameters()] == ["u", "v", "bias"]
    assert torch.equal(net.bias, torch.zeros(3, 64))
    std = (2 / (64 + 8)) ** 0.5  # Xavier-normal of one (64, 8) layer, not of the (3, 64, 8) stack
    assert abs(float(net.u.detach().std()) - std) < 0.15 * std
    assert "rank=8" in repr(net) and "rank=full" in repr(CrossNet(4, 1))


def test_meta_init_then_materialize_equals_eager_construction() -> None:
    torch.manual_seed(5)
    eager = CrossNet(8, 2)
    with mp.empty_init():
        lazy = CrossNet(8, 2)
    assert mp.is_meta(lazy)
    torch.manual_seed(5)
    mp.materialize(lazy, "cpu")
    for (name, a), (_, b) in zip(eager.named_parameters(), lazy.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_gradients_reach_every_parameter() -> None:
    net = CrossNet(4, 2, rank=2)
    net(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (net.u, net.v, net.bias))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"in_features": 0, "num_layers": 1}, "CrossNet(in_features=0): pass a whole number >= 1"),
        ({"in_features": 4, "num_layers": 2.0}, "CrossNet(num_layers=2.0)"),
        ({"in_features": 4, "num_layers": 1, "rank": 0}, "CrossNet(rank=0): pass a whole number"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(mp.ConfigError) as caught:
        CrossNet(**kwargs)
    assert message in str(caught.value)


def test_inputs_of_another_width_are_refused() -> None:
    with pytest.raises(mp.ConfigError, match=r"inputs of width 3, but the layers take 4 features"):
        CrossNet(4, 1)(torch.zeros(2, 3))
