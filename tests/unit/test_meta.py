"""empty_init and materialize: meta allocates nothing, values match eager, owned parts only.

Each rank materializing only its share, on real processes: tests/dist/test_meta_per_rank.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import manualpar as mp
from manualpar.meta import empty_init, is_meta, materialize


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 8)


class Rotary(nn.Module):
    """A buffer computed in __init__ and no reset_parameters(): meta cannot recover it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim), persistent=False
        )


class WithRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), Rotary(8))


def _eager_and_materialized(build: type[nn.Module], seed: int = 3) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    eager = build()
    torch.manual_seed(seed)
    with empty_init():
        lazy = build()
    return eager, lazy


def _assert_equal_state(a: nn.Module, b: nn.Module) -> None:
    left, right = a.state_dict(), b.state_dict()
    assert list(left) == list(right)
    for key in left:
        assert torch.equal(left[key], right[key]), key


def test_nothing_is_allocated_inside_empty_init() -> None:
    with empty_init():
        model = Model()
        huge = nn.Sequential(*[nn.Linear(32768, 32768) for _ in range(10)])  # 10.7e9 params
        norm = nn.BatchNorm1d(4)
    assert sum(p.numel() for p in huge.parameters()) > 10**10
    for module in (model, huge, norm):
        assert is_meta(module)
        assert all(t.is_meta for t in (*module.parameters(), *module.buffers()))
    assert not is_meta(nn.Linear(2, 2))
    with empty_init(enabled=False):
        assert not nn.Linear(2, 2).weight.is_meta


def test_materialize_equals_eager_construction_exactly() -> None:
    torch.manual_seed(3)
    eager = Model()
    after_eager = torch.rand(3)
    torch.manual_seed(3)
    with empty_init():
        lazy = Model()
    assert materialize(lazy, torch.device("cpu")) is lazy
    assert not is_meta(lazy)
    _assert_equal_state(eager, lazy)
    assert torch.equal(torch.rand(3), after_eager), "the RNG advanced exactly as in eager"
    assert torch.equal(lazy.embed.weight[0], torch.zeros(16)), "padding row zeroed"
    assert all(p.requires_grad for p in lazy.parameters())


def test_batchnorm_running_stats_are_reset_on_the_strategy_device() -> None:
    strategy = mp.ManualParallelStrategy(accelerator="cpu")
    with empty_init():
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    materialize(model, strategy)
    norm = model[1]
    assert {t.device for t in (*model.parameters(), *model.buffers())} == {strategy.device}
    assert torch.equal(norm.running_mean, torch.zeros(6))
    assert torch.equal(norm.running_var, torch.ones(6))
    assert norm.num_batches_tracked.item() == 0
    assert torch.equal(norm.weight, torch.ones(6)) and torch.equal(norm.bias, torch.zeros(6))


def test_buffer_without_reset_parameters_raises_naming_the_submodule() -> None:
    with empty_init():
        model = WithRotary()
    with pytest.raises(
        mp.BuilderError,
        match=r"'block\.1' \(Rotary: inv_freq\).*"
        r"add a reset_parameters\(\).*init_fn",
    ):
        materialize(model, "cpu")
    assert is_meta(model.proj), "validated before anything was allocated"
    with pytest.raises(mp.BuilderError, match=r"init_fn did not handle 'block\.1' \(Rotary"):
        materialize(model, "cpu", init_fn=lambda module: False)


class ForgetfulRotary(Rotary):
    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.scale = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.scale)  # forgets to recompute inv_freq


def test_a_buffer_the_initializer_forgot_raises() -> None:
    with empty_init():
        model = nn.Sequential(nn.Linear(8, 8), ForgetfulRotary(8))
    with pytest.raises(
        mp.BuilderError,
        match=r"reset_parameters\(\) of '1' \(ForgetfulRotary\) "
        r"left buffers \['inv_freq'\] uninitialized",
    ):
        materialize(model, "cpu")
    with empty_init():
        model = nn.Sequential(nn.Linear(8, 8), Rotary(8))
    with pytest.raises(mp.BuilderError, match=r"init_fn of '1' \(Rotary\) left buffers"):
        materialize(model, "cpu", init_fn=lambda module: True)


def test_init_fn_recomputes_what_reset_parameters_cannot() -> None:
    eager, lazy = _eager_and_materialized(WithRotary)
    seen: list[str] = []

    def init_rotary(module: nn.Module) -> bool:
        seen.append(type(module).__name__)
        if not isinstance(module, Rotary):
            return False
        dim = module.inv_freq.numel() * 2
        module.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
        return True

    materialize(lazy, "cpu", init_fn=init_rotary)
    assert seen == ["Rotary"], "init_fn is only asked about modules without reset_parameters"
    _assert_equal_state(eager, lazy)
    assert torch.equal(lazy.block[1].inv_freq, eager.block[1].inv_freq)


def test_already_real_parameters_are_not_touched() -> None:
    with empty_init():
        model = Model()
    known = nn.Parameter(torch.full((32, 16), 7.0))
    model.mlp[0].weight = known  # same submodule as a meta bias
    materialize(model.head, "cpu")
    head_weight = model.head.weight
    head_values = head_weight.detach().clone()
    materialize(model, "cpu")
    assert model.mlp[0].weight is known and torch.equal(known, torch.full((32, 16), 7.0))
    assert not model.mlp[0].bias.is_meta
    assert model.head.weight is head_weight and torch.equal(head_weight, head_values)
    assert not is_meta(model)


def test_tied_weights_stay_tied_and_rng_matches_eager() -> None:
    def build() -> nn.Module:
        model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "out": nn.Linear(4, 10)})
        model["out"].weight = model["embed"].weight
        return model

    eager, lazy = _eager_and_materialized(build)
    materialize(lazy, "cpu")
    assert lazy["out"].weight is lazy["embed"].weight
    _assert_equal_state(eager, lazy)  # initialized once, by its first owner (the embedding)


def test_skip_leaves_subtrees_on_meta() -> None:
    with empty_init():
        model = Model()
    materialize(model, "cpu", skip=["mlp"])
    assert is_meta(model.mlp) and not is_meta(model.embed) and not is_meta(model.head)
    with empty_init():
        model = Model()
    materialize(model, "cpu", skip=lambda name, module: isinstance(module, nn.Linear))
    assert is_meta(model.mlp[0]) and is_meta(model.mlp[2]) and is_meta(model.head)
    assert not is_meta(model.embed) and not is_meta(model.norm)
    with pytest.raises(ValueError, match=r"skip names \['mpl'\] are not submodules"):
        materialize(model, "cpu", skip=["mpl"])
    with pytest.raises(ValueError, match="not meta"):
        materialize(model, "meta")


def test_seeded_values_do_not_depend_on_what_else_is_materialized() -> None:
    def layers() -> nn.Sequential:
        with empty_init():
            return nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])

    full, odd = layers(), layers()
    state = torch.get_rng_state()
    materialize(full, "cpu", seed=11)
    materialize(odd, "cpu", seed=11, skip=["0", "2"])
    assert torch.equal(torch.get_rng_state(), state), "the global RNG is left alone"
    for index in (1, 3):
        _assert_equal_state(full[index], odd[index])
    assert not torch.equal(full[1].weight, full[3].weight)
    assert is_meta(odd[0]) and is_meta(odd[2])


class _TwoRanks:
    """What materialize() reads from a strategy: the device and the world size."""

    device = torch.device("cpu")
    world_size = 2


class _WithTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.emb = mp.EmbeddingBagCollection(
            [mp.EmbeddingBagConfig("big", num_embeddings=1024, embedding_dim=16)]
        )


def test_materializing_tables_whole_before_sharding_is_refused_on_several_ranks() -> None:
    with mp.empty_init():
        model = _WithTables()
    with pytest.raises(
        mp.BuilderError,
        match=r"materialize\(\): emb.tables.big would be allocated whole on each of the 2 ranks "
        r"\(0.1 MiB per rank\) before shard_embeddings\(\) shards them; call shard_embeddings",
    ):
        mp.materialize(model, _TwoRanks())
    assert model.fc.weight.is_meta  # refused before allocating anything
    mp.materialize(model, _TwoRanks(), skip=["emb"])  # the fix: dense parts now, tables later
    assert not model.fc.weight.is_meta and model.emb.tables["big"].weight.is_meta
    mp.materialize(model.emb, _TwoRanks())  # whole copies on purpose: the collection itself
    assert not mp.is_meta(model)
    with mp.empty_init():
        single = _WithTables()
    mp.materialize(single, torch.device("cpu"))  # one process: the whole table is the shard
    assert not mp.is_meta(single)
