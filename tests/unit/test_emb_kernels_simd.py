"""Every vector level of the C++ kernels gives the portable loops' bits: AVX-512, AVX2 (the
path of CPUs without AVX-512) and portable, for half-row lookups, half-row updates (float16 to
nearest, bfloat16 stochastically) and initial values, on widths that leave tails and column
blocks that start mid-hash."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from manualpar.embeddings.kernels.native import native_kernels
from tests.support.simd import simd_level

pytestmark = pytest.mark.skipif(
    native_kernels() is None, reason="the C++ kernels could not be built on this machine"
)


def _levels() -> list[int]:
    with simd_level(2) as widest:
        return list(range(widest + 1))


def _at_every_level(compute: Callable[[], torch.Tensor]) -> None:
    with simd_level(0):
        portable = compute()
    levels = _levels()
    if len(levels) == 1:
        pytest.skip("this CPU has neither AVX2 nor AVX-512: only the portable loops run")
    for level in levels[1:]:
        with simd_level(level) as got:
            assert got == level
            result = compute()
        assert torch.equal(result.view(torch.uint8), portable.view(torch.uint8)), level


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [37, 64, 150])
@pytest.mark.parametrize("weighted", [False, True])
def test_half_lookups_equal_the_portable_loop(dtype, cols, weighted):
    generator = torch.Generator().manual_seed(cols)
    weight = torch.randn(500, cols, generator=generator).to(dtype)
    lengths = torch.randint(0, 7, (40,), generator=generator)
    ids = torch.randint(0, 500, (int(lengths.sum()),), generator=generator)
    per_id = torch.rand(ids.shape, generator=generator) if weighted else None
    _at_every_level(lambda: native_kernels().pooled_sum_half(weight, ids, lengths, per_id))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("cols", "col_start"), [(37, 0), (64, 3), (48, 6)])
def test_half_updates_round_as_the_portable_loop(dtype, cols, col_start):
    generator = torch.Generator().manual_seed(cols + col_start)
    start = torch.randn(300, cols, generator=generator).to(dtype)
    rows = torch.randperm(300, generator=generator)[:120]
    delta = torch.randn(120, cols, generator=generator) * 1e-2

    def update() -> torch.Tensor:
        tensor = start.clone()
        native_kernels().add_to_rows_rounded(
            tensor, rows, delta, -0.5, True, 12345, 7, col_start, col_start + cols + 5, None
        )
        return tensor

    _at_every_level(update)
    assert not torch.equal(update(), start)  # the update changed the rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("cols", "col_start", "dim"), [(64, 0, 64), (37, 0, 37), (40, 24, 64)])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_rowwise_updates_equal_the_portable_loop(dtype, cols, col_start, dim, weighted):
    """The fused row-wise Adagrad pass (sum of squares, repeated rows summed over their bags,
    the row written, half rows rounded) gives the portable loop's bits at every level: rows of
    a table's full width (the bfloat16 bits of 32 elements from one vector of hashes), and
    column blocks and widths that leave partial vectors."""
    kernels = native_kernels()
    generator = torch.Generator().manual_seed(cols + col_start)
    start = (torch.randn(300, cols, generator=generator) * 0.1).to(dtype)
    lengths = torch.randint(0, 6, (64,), generator=generator)
    ids = torch.randint(0, 300, (int(lengths.sum()),), generator=generator)
    ids[: ids.numel() // 2] = ids[ids.numel() // 2 : 2 * (ids.numel() // 2)]  # repeated rows
    per_id = torch.rand(ids.shape, generator=generator) if weighted else None
    grads = torch.randn(64, dim, generator=generator)
    groups = kernels.group_rows(ids, lengths, 300, 0, 64)
    runs = groups[4].numel()

    def update() -> torch.Tensor:
        weight, state = start.clone(), torch.zeros(300)
        common = (weight, state, per_id, *groups[:5], 0, runs, [grads], [0.5], 0, 64, col_start)
        if dtype == torch.float32:
            kernels.rowwise_adagrad_update(*common, 0.05, 1e-8)
        else:
            stochastic = dtype == torch.bfloat16
            kernels.rowwise_adagrad_update_rounded(
                *common, 0.05, 1e-8, stochastic, 4242, 3, dim, None
            )
        return torch.cat([weight.float().view(-1), state])

    _at_every_level(update)
    assert not torch.equal(update()[: start.numel()], start.float().view(-1))


@pytest.mark.parametrize(("cols", "col0"), [(37, 0), (64, 5)])
def test_initial_values_equal_the_portable_loop(cols, col0):
    def initial() -> torch.Tensor:
        out = torch.empty(200, cols)
        native_kernels().uniform_rows(out, -7_000_000_000_123, 11, col0, col0 + cols + 2, 0.05)
        return out

    _at_every_level(initial)


def test_the_level_benchmark_times_each_level_against_the_portable_one(tmp_path, monkeypatch):
    from example_modules import EXAMPLES

    monkeypatch.syspath_prepend(str(EXAMPLES / "benchmarks"))
    import bench_simd_levels

    out = tmp_path / "levels.json"
    tiny = ["--rows", "300", "--dim", "24", "--bags", "16", "--update-rows", "50"]
    result = bench_simd_levels.main([*tiny, "--repeats", "2", "--json", str(out)])
    assert result["levels"] == [bench_simd_levels.LEVELS[level] for level in _levels()]
    assert set(result["summary"]) == {
        "lookup bfloat16",
        "update bfloat16",
        "lookup float16",
        "update float16",
        "init float32",
        "fused float32",
        "fused bfloat16",
    }
    for kernel in result["summary"].values():
        assert kernel["vs_portable"]["portable"] == 1.0
        assert set(kernel["ms"]) == set(result["levels"])
    assert out.exists()
