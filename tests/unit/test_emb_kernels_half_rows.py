"""Half-precision tables in one process: rounding, kernels against the torch path, checkpoints
across dtypes, plan bytes. (Training on real ranks:
tests/dist/test_emb_kernels_half_rows_ranks.py.)"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

import manualpar as mp
from manualpar.cli import main
from manualpar.embeddings import (
    SGD,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.kernels import native
from manualpar.embeddings.kernels.half_lookup import pooled_sum_half
from manualpar.embeddings.kernels.rounding import RowRounding, add_rounded
from manualpar.embeddings.modules.table_init import init_rows
from manualpar.embeddings.planning.planner import plan_tables, table_bytes

needs_kernels = pytest.mark.skipif(
    native.native_kernels() is None, reason="no C++ compiler: only the torch path exists"
)


def _rounding(dtype: torch.dtype, step: int = 1, stochastic: bool = True) -> RowRounding:
    # a block at row 100, column 7 of a table 61 wide: element indices not aligned to 4
    rounding = RowRounding.for_block(dtype, 5, "user", step, (100, 7), 61)
    return RowRounding(dtype, rounding.key, 100, 7, 61, stochastic=stochastic)


def _round_both_paths(
    monkeypatch: pytest.MonkeyPatch, start: torch.Tensor, delta: torch.Tensor, rounding: RowRounding
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C++ kernel, torch ops) results of start[rows] + delta for every row."""
    rows = torch.arange(start.shape[0])
    native_result, torch_result = start.clone(), start.clone()
    add_rounded(native_result, rows, delta, 1.0, rounding)
    monkeypatch.setattr(native, "_loaded", None)
    add_rounded(torch_result, rows, delta, 1.0, rounding)
    return native_result, torch_result


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_is_the_same_bits_in_cpp_and_torch(monkeypatch, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(300, 24, generator=generator).to(dtype)
    delta = torch.randn(300, 24, generator=generator) * 1e-2
    native_result, torch_result = _round_both_paths(
        monkeypatch, start, delta, _rounding(dtype, step=3)
    )
    assert torch.equal(native_result, torch_result)
    # float16 rounds to nearest: the torch cast of the float32 sum
    if dtype == torch.float16:
        assert torch.equal(native_result, (start.float() + delta).to(dtype))


def _bfloat16_neighbours(value: float) -> tuple[float, float]:
    """The two bfloat16 values around a float32 one: its top 16 bits, and one unit further."""
    bits = torch.tensor([value], dtype=torch.float32).view(torch.int32) & -(1 << 16)
    toward_zero, away = bits.view(torch.float32), (bits + (1 << 16)).view(torch.float32)
    low, high = sorted((float(toward_zero), float(away)))
    return low, high


@pytest.mark.parametrize("native_path", [True, False])
def test_stochastic_rounding_is_unbiased_and_reproducible(monkeypatch, native_path: bool) -> None:
    if not native_path:
        monkeypatch.setattr(native, "_loaded", None)
    n = 4096
    rows = torch.arange(n)

    def rounded(value: float, step: int) -> torch.Tensor:
        out = torch.zeros(n, 1, dtype=torch.bfloat16)  # n elements: n independent draws
        add_rounded(out, rows, torch.full((n, 1), value), 1.0, _rounding(out.dtype, step))
        return out

    for value in (1.0 + 2**-10, -3.0 - 0.3 * 2**-6, 0.1234567, 7e-5):
        value = float(torch.tensor(value, dtype=torch.float32))
        low, high = _bfloat16_neighbours(value)
        got = rounded(value, step=1)
        assert set(got.float().flatten().tolist()) <= {low, high}, value
        # unbiased: n choices between low and high (p = the fraction dropped) average within 5
        # standard deviations, (high - low) * sqrt(p (1 - p) / n) <= (high - low) / (2 sqrt n)
        mean = float(got.double().mean())
        assert abs(mean - value) <= 5 * (high - low) / (2 * math.sqrt(n)), (value, mean)
        assert torch.equal(rounded(value, step=1), got)  # same seed and step: same bits
        assert not torch.equal(rounded(value, step=2), got)  # the next step draws others


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_sums_of_half_rows_are_float32_and_the_same_bits_on_both_paths(
    monkeypatch, dtype: torch.dtype, weighted: bool
) -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(500, 40, generator=generator).to(dtype)
    lengths = torch.randint(0, 30, (64,), generator=generator)
    lengths[3] = 0  # an empty bag sums to zeros
    ids = torch.randint(0, 500, (int(lengths.sum()),), generator=generator)
    per_id = torch.rand(ids.numel(), generator=generator) if weighted else None
    native_sum = pooled_sum_half(weight, ids, lengths, per_id)
    monkeypatch.setattr(native, "_loaded", None)
    torch_sum = pooled_sum_half(weight, ids, lengths, per_id)
    assert native_sum.dtype == torch.float32
    assert torch.equal(native_sum, torch_sum)
    per_id_double = None if per_id is None else per_id.double()
    offsets = torch.cumsum(lengths, 0) - lengths
    expected = torch.nn.functional.embedding_bag(
        ids, weight.double(), offsets, mode="sum", per_sample_weights=per_id_double
    )
    torch.testing.assert_close(native_sum.double(), expected, rtol=1e-6, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_initial_half_rows_are_the_float32_values_rounded_on_both_paths(
    monkeypatch, dtype: torch.dtype
) -> None:
    config = EmbeddingBagConfig("t", 3000, 24, dtype=dtype)
    native_block = init_rows(config, 3, (1000, 3000), (5, 24))
    fp32 = init_rows(EmbeddingBagConfig("t", 3000, 24), 3, (1000, 3000), (5, 24))
    monkeypatch.setattr(native, "_loaded", None)
    torch_block = init_rows(config, 3, (1000, 3000), (5, 24))
    assert native_block.dtype == dtype
    assert torch.equal(native_block, torch_block)
    assert torch.equal(native_block, fp32.to(dtype))


def _sgd_on_constant_gradient(dtype: torch.dtype, steps: int, lr: float) -> torch.Tensor:
    """Every row looked up once per step with gradient 1 per element: each step adds -lr."""
    config = EmbeddingBagConfig("t", 64, 16, dtype=dtype, init_bound=1.0)
    emb = shard_embeddings(
        EmbeddingBagCollection([config], seed=2), mp.ManualParallelStrategy(), "auto", SGD(lr=lr)
    )
    batch = SparseFeatures.from_dict({"t": [[row] for row in range(64)]})
    for _ in range(steps):
        emb(batch).values.sum().backward()
    return emb.tables["t"].weight.detach().float()


def test_bfloat16_stochastic_rounding_keeps_updates_that_round_to_nearest_loses() -> None:
    # each update is below half a bfloat16 unit (2^-9) for 0.5 < |w| < 1 (all |w| < 1 here)
    steps, lr = 40, 1e-3
    start = EmbeddingBagCollection([EmbeddingBagConfig("t", 64, 16, init_bound=1.0)], seed=2)
    initial = start.tables["t"].weight.detach().to(torch.bfloat16)
    nearest = initial.clone()
    for _ in range(steps):  # what rounding to nearest would do with the same updates
        nearest = (nearest.float() - lr).to(torch.bfloat16)
    trained = _sgd_on_constant_gradient(torch.bfloat16, steps, lr)
    large = initial.float().abs() > 0.5
    expected_shift = -steps * lr  # float32 arithmetic moves every element by this
    nearest_shift = float((nearest.float() - initial.float())[large].mean())
    sr_shift = float((trained - initial.float())[large].mean())
    assert abs(nearest_shift) < 0.05 * abs(expected_shift)  # lost (all but none move)
    # kept: the mean of ~500 elements, each a sum of 40 roundings of at most one unit
    # (2^-8 for 0.5 <= |w| < 1) with variance <= unit^2 / 4, is within 4 standard deviations
    tolerance = 4 * math.sqrt(steps / 4) * 2**-8 / math.sqrt(int(large.sum()))
    assert abs(sr_shift - expected_shift) <= tolerance, (sr_shift, expected_shift)


def test_unsharded_half_collection_returns_float32_and_trains_its_half_rows() -> None:
    config = EmbeddingBagConfig("t", 10, 4, dtype=torch.float16, pooling="mean")
    ebc = EmbeddingBagCollection([config])
    out = ebc(SparseFeatures.from_dict({"t": [[1, 2], [], [3]]})).values
    assert out.dtype == torch.float32
    weight = ebc.tables["t"].weight
    expected = weight.detach().float()[[1, 2]].mean(0)
    assert torch.equal(out[0], expected) and torch.equal(out[1], torch.zeros(4))
    out.sum().backward()
    assert weight.grad is not None and weight.grad.is_sparse and weight.grad.dtype == torch.float16


def test_planner_and_plan_command_count_weights_by_dtype(capsys: pytest.CaptureFixture) -> None:
    half = EmbeddingBagConfig("t", 1000, 64, dtype=torch.bfloat16)
    assert table_bytes(half) == 1000 * (64 * 2 + 4)  # bfloat16 weights, one float32 per row
    assert table_bytes(EmbeddingBagConfig("t", 1000, 64)) == 1000 * (64 * 4 + 4)
    plan = plan_tables([half], 2, memory_budget_bytes=10**9)
    assert plan.bytes_per_rank([half]) == [1000 * 132] * 2  # replicated: 128.9 KiB each
    code = main(
        [
            "plan",
            "--world-size",
            "2",
            "--plan",
            "table_wise",
            "--table",
            "a:1000000:64",
            "--table",
            "b:1000000:64",
            "--table-dtype",
            "fp16",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert lines[1].split()[:6] == ["a", "1000000", "x", "64", "fp16", "table_wise[0]"]
    assert lines[3] == "  bytes per rank (weights + row-wise state): r0: 125.9 MiB, r1: 125.9 MiB"
    code = main(["plan", "--world-size", "2", "--table", "a:10:4", "--table-dtype", "fp8"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --table-dtype: table dtype 'fp8' is not supported; use one of fp32, fp16, bf16 "
        "(or float32, float16, bfloat16)"
    )


def test_plan_command_reads_dtypes_from_a_tables_file(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    spec = tmp_path / "tables.json"
    spec.write_text(
        '[{"name": "a", "num_embeddings": 1000000, "embedding_dim": 64, "dtype": "bfloat16"},'
        ' {"name": "b", "num_embeddings": 1000000, "embedding_dim": 64}]'
    )
    assert main(["plan", "--world-size", "2", "--plan", "table_wise", "--tables", str(spec)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # the larger (float32) table is placed first, on the emptiest rank
    assert lines[1].split()[4:6] == ["bf16", "table_wise[1]"]
    assert lines[2].split()[4] == "table_wise[0]"
    assert lines[3] == "  bytes per rank (weights + row-wise state): r0: 248.0 MiB, r1: 125.9 MiB"


def _collection(dtype: torch.dtype, seed: int, plan: EmbeddingPlan):
    tables = [
        EmbeddingBagConfig("user", 40, 8, dtype=dtype),
        EmbeddingBagConfig("item", 30, 4, dtype=dtype),
    ]
    with mp.empty_init():
        ebc = EmbeddingBagCollection(tables, seed=seed)
    return shard_embeddings(ebc, mp.ManualParallelStrategy(), plan, RowWiseAdagrad(lr=0.1))


def _trained(dtype: torch.dtype) -> object:
    emb = _collection(dtype, 1, EmbeddingPlan(1, {"user": table_wise(0), "item": row_wise()}))
    batch = SparseFeatures.from_dict({"user": [[1, 2], [3]], "item": [[4], [5, 5]]})
    for _ in range(2):
        emb(batch).values.square().sum().backward()
    return emb


@pytest.mark.parametrize("full", [False, True])
def test_checkpoints_keep_the_dtype_and_convert_across_dtypes_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, full: bool
) -> None:
    strategy = mp.ManualParallelStrategy()
    other_plan = EmbeddingPlan(1, {"user": row_wise(), "item": table_wise(0)})
    saved = {}
    for dtype in (torch.bfloat16, torch.float32):
        emb = _trained(dtype)
        path = tmp_path / (f"{dtype}.pt" if full else str(dtype))
        strategy.save_checkpoint(
            path, {"model": emb, "sparse_optim": emb.fused_optimizer}, full=full
        )
        saved[dtype] = (path, emb)
    cases = [  # (saved, loaded into): bit-exact, rounded to nearest, widened exactly
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ]
    for saved_dtype, dtype in cases:
        path, source = saved[saved_dtype]
        target = _collection(dtype, 7, other_plan)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="manualpar.checkpoint"):
            strategy.load_checkpoint(
                path, {"model": target, "sparse_optim": target.fused_optimizer}
            )
        for name in ("user", "item"):
            got = target.tables[name].weight
            assert got.dtype == dtype
            assert torch.equal(got, source.tables[name].weight.detach().to(dtype))
            assert torch.equal(
                target.fused_optimizer.table_state[name]["sum"],
                source.fused_optimizer.table_state[name]["sum"],
            )
        conversions = [r.getMessage() for r in caplog.records if "converted" in r.getMessage()]
        if saved_dtype == dtype:
            assert conversions == []
        else:
            assert conversions == [
                f"rank 0: model/tables.{name}.weight was saved as {saved_dtype} in {path}; "
                f"loading it into {dtype} (converted)"
                for name in ("user", "item")
            ]
