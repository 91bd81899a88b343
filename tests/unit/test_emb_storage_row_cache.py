"""RowCache alone: slots, pins, dirty rows and the LRU / LFU choice of victims."""

from __future__ import annotations

import pytest
import torch

from manualpar.embeddings.storage.row_cache import (
    LOGGED,
    NEVER,
    STORED,
    CacheFull,
    RowCache,
    SlotAssignment,
)


def rows(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def step(cache: RowCache, *ids: int, updated: bool = True) -> torch.Tensor:
    """One step's rows: assigned (pinned), then released as backward does."""
    cache.new_step()
    assignment = cache.assign(rows(*ids))
    cache.release(assignment.slots, updated)
    return assignment.slots


def cached(cache: RowCache) -> set[int]:
    return {int(r) for r in cache.row_of if r >= 0}


def test_misses_fetch_then_hits_reuse_slots() -> None:
    cache = RowCache(100, 4)
    cache.new_step()
    first = cache.assign(rows(7, 3))
    assert first.fetch_rows.tolist() == [7, 3]
    assert first.origins.tolist() == [NEVER, NEVER]  # generated
    cache.release(first.slots, updated=False)
    cache.new_step()
    again = cache.assign(rows(3, 7))
    assert again.slots.tolist() == first.slots.flip(0).tolist()
    assert again.fetch_rows.numel() == 0 and (cache.hits, cache.misses) == (2, 2)


def _fill_then_evict(policy: str) -> set[int]:
    """Rows 0 and 1 used often long ago (1 once more since), rows 2 and 3 once recently;
    then one new row."""
    cache = RowCache(100, 4, policy)
    for _ in range(3):
        step(cache, 0, 1)
    step(cache, 2)
    step(cache, 1)
    step(cache, 3)
    cache.new_step()
    cache.assign(rows(9))  # evicts a batch: at least one slot
    return cached(cache)


def test_lru_evicts_the_least_recently_used() -> None:
    assert _fill_then_evict("lru") == {1, 2, 3, 9}  # row 0: its last use is the oldest


def test_lfu_evicts_the_least_frequently_used() -> None:
    assert _fill_then_evict("lfu") == {0, 1, 3, 9}  # row 2: used once, before row 3


def test_lrfu_evicts_by_last_use_plus_a_reach_per_use(monkeypatch) -> None:
    """Keys: row 0 used in steps 1-3, row 1 in 5-6, row 3 in 4 and 7-9, row 2 in 12; then a
    new row. LRU evicts row 0 (the oldest use), LFU row 2 (one use), LRFU (last use + 4 steps
    a use) row 1: 6 + 8 against 3 + 12, 12 + 4 and 9 + 16."""
    from manualpar.embeddings.storage import row_cache

    monkeypatch.setattr(row_cache, "LRFU_REACH", 4)
    monkeypatch.setattr(row_cache, "LRFU_USES", 8)
    left = {}
    for policy in ("lru", "lfu", "lrfu"):
        for native in (True, False):
            cache = RowCache(100, 4, policy)
            cache.native = native
            for used in ([0], [0], [0], [3], [1], [1], [3], [3], [3], [], [], [2]):
                if used:
                    step(cache, *used)
                else:
                    cache.new_step()
            cache.new_step()
            cache.assign_ids(rows(9))  # evicts one slot (a batch of 4 // 16 = 0, at least 1)
            left[policy, native] = cached(cache)
    for native in (True, False):
        assert left["lru", native] == {1, 2, 3, 9}
        assert left["lfu", native] == {0, 1, 3, 9}
        assert left["lrfu", native] == {0, 2, 3, 9}


def test_lrfu_forgets_uses_past_its_reach(monkeypatch) -> None:
    """A row used in every step long ago is evicted before a row used once lately, once its
    uses (at most LRFU_USES count) no longer reach past it; LFU keeps it."""
    from manualpar.embeddings.storage import row_cache

    monkeypatch.setattr(row_cache, "LRFU_REACH", 2)
    monkeypatch.setattr(row_cache, "LRFU_USES", 3)
    for policy, kept in (("lrfu", {1, 9}), ("lfu", {0, 9})):
        cache = RowCache(100, 2, policy)
        for _ in range(20):
            step(cache, 0)  # 20 uses: 3 count, reaching 6 steps past step 20
        for _ in range(10):
            cache.new_step()
        step(cache, 1)  # step 31: one use, reaching step 33
        cache.new_step()
        cache.assign(rows(9))
        assert cached(cache) == kept, policy


def test_evicted_dirty_rows_are_written_back_and_later_read_from_the_file() -> None:
    cache = RowCache(100, 2)
    step(cache, 5, updated=True)
    step(cache, 6, updated=False)  # generated, so dirty too: not in the file yet
    cache.new_step()
    assignment = cache.assign(rows(7, 8))
    assert sorted(assignment.evict_rows.tolist()) == [5, 6]
    assert cache.slot_of[5] == STORED and cache.slot_of[7] >= 0 and cache.slot_of[9] == NEVER
    cache.release(assignment.slots, updated=False)
    cache.new_step()
    back = cache.assign(rows(5))
    assert back.fetch_rows.tolist() == [5] and back.origins.tolist() == [STORED]
    assert not cache.dirty[back.slots].any()  # the file holds it: clean until updated


def test_logged_rows_are_read_from_the_log_and_written_again() -> None:
    """A row whose latest values are in the write log: its code names the log record, it is
    fetched from there, and once cached it is dirty, so an eviction appends it again (the log
    holds no clean row); draining makes logged rows stored at their places."""
    cache = RowCache(100, 2)
    step(cache, 5, 6)
    cache.new_step()
    evicted = cache.assign(rows(7, 8)).evict_rows
    cache.mark_logged(evicted, torch.tensor([10, 11]))  # as WriteLog.append does
    assert cache.slot_of[evicted].tolist() == [LOGGED - 10, LOGGED - 11]
    logged, at = cache.logged_rows()
    assert (logged.tolist(), at.tolist()) == (evicted.sort().values.tolist(), [10, 11])
    cache.release(cache.row_of.ne(-1).nonzero().flatten(), updated=False)
    cache.new_step()
    back = cache.assign(rows(int(evicted[1])))
    assert back.origins.tolist() == [LOGGED - 11] and cache.dirty[back.slots].all()
    assert cache.logged_rows()[0].tolist() == [int(evicted[0])]
    cache.mark_drained(cache.logged_rows()[0])
    assert cache.slot_of[evicted[0]] == STORED and cache.logged_rows()[0].numel() == 0


def test_pinned_rows_are_never_evicted_and_overflow_leaves_the_cache_as_it_was() -> None:
    cache = RowCache(100, 3)
    cache.new_step()
    pinned = cache.assign(rows(1, 2))  # forward of a step whose backward has not run
    with pytest.raises(CacheFull) as error:
        cache.assign(rows(3, 4))
    assert (error.value.needed, error.value.capacity) == (4, 3)
    assert cached(cache) == {1, 2} and cache.pins[pinned.slots].tolist() == [1, 1]
    cache.release(pinned.slots, updated=True)
    assert sorted(cache.assign(rows(3, 4)).fetch_rows.tolist()) == [3, 4]


def test_dirty_entries_and_drop_all() -> None:
    cache = RowCache(10, 4)
    step(cache, 1, 2)
    dirty_rows, _ = cache.dirty_entries()
    assert sorted(dirty_rows.tolist()) == [1, 2] and cache.dirty_entries()[0].numel() == 0
    assert cache.never_written(0, 10).tolist() == [0, 3, 4, 5, 6, 7, 8, 9]
    cache.drop_all()
    assert (cache.slot_of == STORED).all() and cached(cache) == set()


def _state(cache: RowCache) -> dict[str, object]:
    names = ("slot_of", "row_of", "pins", "dirty", "last_used", "uses", "free")
    state: dict[str, object] = {name: getattr(cache, name).tolist() for name in names}
    state["stats"] = (cache.hits, cache.misses, cache.evictions)
    return state


@pytest.mark.parametrize("policy", ["lru", "lfu", "lrfu"])
def test_the_cpp_pass_leaves_the_state_of_the_torch_path(policy: str) -> None:
    """Skewed ids with repeats, two calls a step, evictions in batches, a cache too small
    once: the C++ pass and the torch path give the same slots, victims and state."""
    from manualpar.embeddings.kernels.native import native_kernels

    if native_kernels() is None:
        pytest.skip("the C++ kernels could not be built on this machine")
    native, torch_path = RowCache(500, 64, policy), RowCache(500, 64, policy)
    torch_path.native = False
    from_log = evicted_before = 0
    generator = torch.Generator().manual_seed(3)
    for index in range(40):
        pins = []
        for cache in (native, torch_path):
            cache.new_step()
        for _ in range(2):
            skewed = torch.randint(0, 500, (40,), generator=generator) ** 2 // 500
            size = 70 if index == 17 else 30  # step 17 asks more than the cache holds
            ids = skewed[:size] if size <= 40 else torch.cat([skewed, torch.arange(40, 70)])
            outcomes = []
            for cache in (native, torch_path):
                try:
                    outcomes.append(cache.assign_ids(ids))
                except CacheFull as full:
                    outcomes.append((full.needed, full.capacity))
            (ours, a), (theirs, b) = outcomes
            if isinstance(ours, int):
                assert (ours, a) == (theirs, b)
                continue
            assert isinstance(a, SlotAssignment) and isinstance(b, SlotAssignment)
            assert ours.tolist() == theirs.tolist()
            assert (native.row_of[ours] == ids).all()
            assert sorted(a.slots.tolist()) == sorted(b.slots.tolist())
            for name in ("evict_rows", "evict_slots", "fetch_rows", "fetch_slots", "origins"):
                assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
            assert a.evict_rows.tolist() == sorted(a.evict_rows.tolist())  # as written
            evicted_before += a.evict_rows.numel()
            pins.append(a.slots)
            from_log += int((a.origins <= LOGGED).sum())
            # every other victim to the write log: read back from there, and dirty once read
            logged = a.evict_rows[::2]
            for cache in (native, torch_path):
                cache.mark_logged(logged, torch.arange(logged.numel()) + 7 * index)
        for slots in pins:
            native.release(slots, updated=index % 3 != 0)
            torch_path.release(slots, updated=index % 3 != 0)
        assert _state(native) == _state(torch_path)
    assert native.evictions > 64 and evicted_before > 8  # the cache turned over
    assert from_log > 0 and native.logged_rows()[0].numel() > 0  # rows read from the log
