"""The C++ backward kernels against the pure-torch path (which CUDA and compiler-less hosts use):
duplicate-id sums, the fused row-wise Adagrad (column blocks included), row updates."""

from __future__ import annotations

import pytest
import torch

from manualpar.embeddings import RowWiseAdagrad
from manualpar.embeddings.kernels import bags as kernels
from manualpar.embeddings.kernels import native

pytestmark = pytest.mark.skipif(
    native.native_kernels() is None, reason="the C++ kernels could not be built on this machine"
)


def _case(dtype: torch.dtype, weighted: bool, rows: int = 300, bags: int = 40):
    generator = torch.Generator().manual_seed(7)
    lengths = torch.randint(0, 9, (bags,), generator=generator)
    lengths[3] = 0  # an empty bag
    ids = torch.randint(0, rows // 10, (int(lengths.sum()),), generator=generator) * 7 % rows
    weights = torch.rand(ids.shape, generator=generator, dtype=dtype) if weighted else None
    grads = torch.randn(bags, 12, generator=generator, dtype=dtype)
    return ids, lengths, weights, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weighted", [False, True])
def test_segment_sum_matches_torch(dtype, weighted, monkeypatch):
    ids, lengths, weights, grads = _case(dtype, weighted)
    rows, summed = kernels.row_gradients(ids, lengths, weights, grads, 300, scale=0.25)
    monkeypatch.setattr(native, "_loaded", None)
    expected_rows, expected = kernels.row_gradients(ids, lengths, weights, grads, 300, scale=0.25)
    assert torch.equal(rows, expected_rows)
    assert torch.equal(rows, torch.unique(ids))
    torch.testing.assert_close(summed, expected)


def _reference_update(ids, lengths, weights, grads, cols, col_start, scale):
    """Pure torch: per-row sums, then the per-row rule on this column block."""
    rule = RowWiseAdagrad(lr=0.1, eps=1e-8)
    weight = torch.randn(300, cols, generator=torch.Generator().manual_seed(1))
    state = {"sum": torch.rand(300, generator=torch.Generator().manual_seed(2))}
    expected_weight, expected_state = weight.clone(), {"sum": state["sum"].clone()}
    rows, summed = kernels.row_gradients(ids, lengths, weights, grads, 300, scale=scale)
    rule.step_rows(
        expected_weight,
        expected_state,
        rows,
        summed[:, col_start : col_start + cols],
        1,
        summed.square().mean(1),
    )
    return rule, weight, state, expected_weight, expected_state, rows


@pytest.mark.parametrize("col_start, cols", [(0, 12), (4, 5)])
def test_fused_rowwise_adagrad_matches_row_by_row(col_start, cols):
    ids, lengths, weights, grads = _case(torch.float32, weighted=True)
    rule, weight, state, expected_weight, expected_state, rows = _reference_update(
        ids, lengths, weights, grads, cols, col_start, scale=0.5
    )
    bags = kernels.ShardBags(ids, lengths, weights, 0, lengths.numel())
    bags.groups = kernels.group_rows(bags, 300)
    grads_in = kernels.BagGradients([grads], [0.5])
    assert rule.step_bags(weight, state, bags, grads_in, col_start, 1, kernels.RowPass.ALL)
    torch.testing.assert_close(weight, expected_weight)
    torch.testing.assert_close(state["sum"], expected_state["sum"])
    untouched = torch.ones(300, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(state["sum"][untouched], expected_state["sum"][untouched])


def test_fused_update_in_two_passes_equals_one():
    """This rank's rows first (the other bags' gradients absent), then the rest, from strided
    blocks with one scale per sender: the same result as one pass over one dense gradient."""
    ids, lengths, weights, grads = _case(torch.float32, weighted=True)
    own = (10, 25)  # bags 10..24 are "this rank's", between two other senders'; bag 3 is empty
    scales = [0.2, 0.25, 0.55]
    per_bag = torch.cat(
        [torch.full((10,), scales[0]), torch.full((15,), scales[1]), torch.full((15,), scales[2])]
    )
    rule, weight, state, expected_weight, expected_state, _ = _reference_update(
        ids, lengths, weights, grads * per_bag.unsqueeze(1), 12, 0, scale=1.0
    )
    wide = torch.randn(15, 30)
    wide[:, 7:19] = grads[10:25]  # the own block as a column slice of a wider output
    blocks = [grads[:10], wide[:, 7:19], grads[25:]]
    bags = kernels.ShardBags(ids, lengths, weights, *own)
    bags.groups = kernels.group_rows(bags, 300)
    before = weight.clone()
    assert rule.step_bags(
        weight,
        state,
        bags,
        kernels.BagGradients(blocks[1:2], scales[1:2]),
        0,
        1,
        kernels.RowPass.OWN,
    )
    starts = torch.cumsum(lengths, 0) - lengths
    own_ids = ids[int(starts[own[0]]) : int(starts[own[1]])]
    other_ids = torch.cat([ids[: int(starts[own[0]])], ids[int(starts[own[1]]) :]])
    changed = set(torch.nonzero((weight != before).any(1)).flatten().tolist())
    assert changed == set(own_ids.tolist()) - set(other_ids.tolist())
    assert rule.step_bags(
        weight, state, bags, kernels.BagGradients(blocks, scales), 0, 1, kernels.RowPass.REST
    )
    torch.testing.assert_close(weight, expected_weight)
    torch.testing.assert_close(state["sum"], expected_state["sum"])


def test_fused_update_refuses_missing_gradients():
    ids, lengths, _, grads = _case(torch.float32, weighted=False)
    bags = kernels.ShardBags(ids, lengths, None, 0, lengths.numel())
    bags.groups = kernels.group_rows(bags, 300)
    rule = RowWiseAdagrad(lr=0.1)
    with pytest.raises(
        RuntimeError,
        match=r"gradients given for 20 bags, but these rows occur "
        r"in bags 0\.\.39",
    ):
        rule.step_bags(
            torch.zeros(300, 12),
            {"sum": torch.zeros(300)},
            bags,
            kernels.BagGradients([grads[:20]], [1.0]),
            0,
            1,
            kernels.RowPass.ALL,
        )


def test_add_to_rows_matches_index_add():
    tensor = torch.randn(50, 6, dtype=torch.float64)
    rows = torch.tensor([1, 4, 9, 49])
    delta = torch.randn(4, 6, dtype=torch.float64)
    expected = tensor.clone().index_add_(0, rows, delta, alpha=-0.5)
    kernels.add_to_rows(tensor, rows, delta, alpha=-0.5)
    torch.testing.assert_close(tensor, expected)


def test_kernels_refuse_ids_outside_the_table():
    ids, lengths, _, grads = _case(torch.float32, weighted=False)
    ids = ids % 100
    ids[5] = 280
    with pytest.raises(RuntimeError, match=r"id 280 outside \[0, 100\)"):
        native.native_kernels().segment_sum(ids, lengths, None, grads, 100, 1.0)


def test_non_cpu_or_other_float_dtypes_take_the_torch_path():
    # half rows have kernels of their own (half_lookup.py, rounding.py); other floats do not
    assert native.native_kernels_take(torch.zeros(2, dtype=torch.bfloat16))
    assert not native.native_kernels_take(torch.zeros(2, dtype=torch.float8_e4m3fn))
    assert not native.native_kernels_take(torch.zeros(2, device="meta"))
    assert native.native_kernels_take(torch.zeros(2), None, torch.zeros(2, dtype=torch.int64))


def test_initial_values_are_the_same_bits_on_both_paths(monkeypatch):
    from manualpar.embeddings import EmbeddingBagConfig
    from manualpar.embeddings.modules.table_init import init_rows

    config = EmbeddingBagConfig("t", 9000, 24, feature_names=("f",), init_bound=0.5)
    native_block = init_rows(config, 3, (4000, 9000), (5, 24))
    native_double = init_rows(
        config, 3, (0, 10), (0, 24), out=torch.empty(10, 24, dtype=torch.float64)
    )
    monkeypatch.setattr(native, "_loaded", None)
    torch_block = init_rows(config, 3, (4000, 9000), (5, 24))
    assert torch.equal(native_block, torch_block)
    assert torch.equal(native_double, init_rows(config, 3, (0, 10), (0, 24)).double())
    assert -0.5 <= float(torch_block.min()) < -0.49 and 0.49 < float(torch_block.max()) < 0.5
    assert not torch.equal(torch_block, init_rows(config, 4, (4000, 9000), (5, 24)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_initial_values_written_into_scattered_slots_are_the_same_bits_on_both_paths(
    monkeypatch, dtype
):
    """The disk tier generates rows on first use straight into its cache slots."""
    from manualpar.embeddings import EmbeddingBagConfig
    from manualpar.embeddings.modules.table_init import init_rows, init_rows_into

    config = EmbeddingBagConfig("t", 9000, 24, feature_names=("f",), init_bound=0.5)
    rows, slots = torch.tensor([8999, 3, 4000, 17]), torch.tensor([2, 5, 0, 3])
    native_out = torch.zeros(6, 19, dtype=dtype)
    init_rows_into(config, 3, rows, (5, 24), native_out, slots)
    monkeypatch.setattr(native, "_loaded", None)
    torch_out = torch.zeros(6, 19, dtype=dtype)
    init_rows_into(config, 3, rows, (5, 24), torch_out, slots)
    assert torch.equal(native_out, torch_out)
    for row, slot in zip(rows.tolist(), slots.tolist(), strict=True):
        block = init_rows(config, 3, (row, row + 1), (5, 24), out=torch.empty(1, 19, dtype=dtype))
        assert torch.equal(native_out[slot], block[0])
    assert not native_out[[1, 4]].any()  # other slots untouched


def test_split_by_rows_matches_torch(monkeypatch):
    from manualpar.embeddings import EmbeddingBagConfig, EmbeddingPlan, row_wise
    from manualpar.embeddings.step.exchange import split_by_rows
    from manualpar.embeddings.step.routing import Routing

    config = EmbeddingBagConfig("t", 300, 4, feature_names=("f",))
    routing = Routing((config,), EmbeddingPlan(3, {"t": row_wise()}), 0)
    ids, lengths, _, _ = _case(torch.float32, weighted=False)
    native_result = split_by_rows(ids, lengths, routing, 0)
    monkeypatch.setattr(native, "_loaded", None)
    torch_result = split_by_rows(ids, lengths, routing, 0)
    for native_part, torch_part in zip(native_result, torch_result, strict=True):
        assert torch.equal(native_part, torch_part)
    counts, local, _ = torch_result
    assert counts.shape == (3, lengths.numel()) and int(counts.sum()) == ids.numel()
    assert torch.equal(counts.sum(0), lengths)
    assert int(local.max()) < 100 and int(local.min()) >= 0


def test_huge_page_advice_is_given_to_large_cpu_blocks_and_can_be_switched_off(monkeypatch):
    from manualpar.embeddings.kernels import row_memory as memory

    advised = []
    monkeypatch.setattr(memory, "_madvise_range", lambda *span: advised.append(span) or True)
    monkeypatch.setattr(memory, "_current", None)
    assert memory.zeros_rows(4096, 256).abs().sum() == 0  # 4 MiB: carved from advised memory
    memory.empty_rows(10, 4)  # small: not advised
    assert len(advised) == 1
    monkeypatch.undo()
    monkeypatch.setenv("MANUALPAR_HUGE_PAGES", "0")
    assert not memory._madvise_huge(torch.empty(4096, 256))


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    assert not native.clear_stale_lock(tmp_path, max_age_s=600) and lock.exists()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="removed a stale build lock"):
        assert native.clear_stale_lock(tmp_path, max_age_s=600)
    assert not lock.exists()
    assert not native.clear_stale_lock(tmp_path)  # nothing there


@pytest.mark.timeout(60)
def test_waiting_on_a_build_ends_when_its_lock_goes_or_grows_stale(tmp_path):
    """A build killed mid-way leaves its lock; a later process waits for it only until the lock
    is stale, where torch's loader would wait forever."""
    import os
    import threading
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    almost = time.time() - 599.5  # stale half a second from now
    os.utime(lock, (almost, almost))
    with pytest.warns(RuntimeWarning, match="removed a stale build lock"):
        native.wait_for_build(tmp_path, max_age_s=600, poll_s=0.05)
    assert not lock.exists()
    lock.write_text("")  # a live build that finishes
    finished = threading.Timer(0.3, lock.unlink)
    finished.start()
    native.wait_for_build(tmp_path, max_age_s=600, poll_s=0.05)
    finished.join()
    assert not lock.exists()


def test_vectorized_sum_of_squares_agrees_to_the_bit():
    """Row-wise Adagrad's state adds the row's squares in fixed lanes; the AVX version (chosen
    at run time) must give the portable version's bits, or states would differ by machine."""
    generator = torch.Generator().manual_seed(3)
    for width in (1, 7, 8, 64, 67, 128):
        row = torch.randn(width, generator=generator) * torch.logspace(-3, 3, width)
        portable, dispatched = native.native_kernels().sum_squares_versions(row)
        assert portable == dispatched, width
        assert portable == pytest.approx(float(row.double().square().sum()), rel=1e-12)


@pytest.mark.parametrize("num_rows", [1, 5, 2**11 + 3, 2**13 + 1, 2**22 + 9, 2**25 + 7, 2**55])
def test_grouping_orders_ids_stably_in_any_row_space(num_rows):
    """The radix sort under group_rows takes as many digit bits as the row space needs (two
    passes up to 26 bits, a table batch's rows): each id's occurrences in position order, ids
    ascending, whatever the number of passes. Its keys carry the bag and position with the row,
    or (2**55 rows: the three do not fit 64 bits) the position only."""
    generator = torch.Generator().manual_seed(num_rows)
    lengths = torch.randint(0, 4, (200,), generator=generator)
    count = int(lengths.sum())
    ids = torch.randint(0, num_rows, (count,), generator=generator)
    ids[: count // 3] = ids[count // 3 : 2 * (count // 3)]  # repeated ids
    ids[-1] = num_rows - 1  # the top of the row space
    bag_of = torch.repeat_interleave(torch.arange(200), lengths)
    expected = torch.sort(ids, stable=True).indices
    # own bags from the first, in the middle (bags below them are not own), none
    for own_begin, own_end in ((0, 100), (50, 150), (120, 120)):
        shard = kernels.ShardBags(ids, lengths, None, own_begin, own_end)
        groups = kernels.group_rows(shard, num_rows)
        assert groups is not None
        assert torch.equal(groups.order, expected)
        assert torch.equal(groups.rows, torch.unique(ids))
        assert torch.equal(groups.bags, bag_of[expected])
        # the runs whose bags all lie in [own_begin, own_end) first, then the others, each by
        # ascending row
        starts, runs = groups.starts, groups.runs
        bags_of_run = [bag_of[expected[starts[u] : starts[u + 1]]] for u in range(len(starts) - 1)]
        own = [bool(((b >= own_begin) & (b < own_end)).all()) for b in bags_of_run]
        assert runs.tolist() == [u for u, mine in enumerate(own) if mine] + [
            u for u, mine in enumerate(own) if not mine
        ]
        assert groups.num_own == sum(own)
