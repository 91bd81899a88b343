"""TrainPipeline over a disk tier: the next batch's rows are read into the cache and pinned
before the current step, and the tables, the optimizer state and the losses are the plain
loop's, bit for bit (2 and 3 ranks); a cache too small for two batches falls back to reading
in the step (said once, same numbers); dropping a held batch and a checkpoint taken with one in
flight leave nothing pinned and resume exactly; a loader that raises with a batch's rows pinned
reaches the loop with its own traceback and leaves nothing pinned."""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_tier_cases import batch, build, snapshot

import manualpar as mp
from manualpar.checkpoint.extra import extra_checkpoint_entries
from manualpar.embeddings import DiskTier, SparseFeatures
from manualpar.testing import run_distributed

STEPS = 6


def _batches(rank: int, steps: range) -> Iterator[SparseFeatures]:
    return (batch(rank, step, "zipf") for step in steps)


def _step(emb: Any, features: SparseFeatures) -> float:
    loss = emb(features).values.square().mean()
    loss.backward()
    return float(loss)


def _train(directory: str, pipelined: bool, cache_rows: int) -> dict[str, Any]:
    strategy = mp.ManualParallelStrategy()
    emb = build(strategy, "rowwise", DiskTier(directory, cache_rows=cache_rows))
    cache = emb.storage.by_name["big"].cache
    batches = _batches(strategy.rank, range(STEPS))
    loop = mp.TrainPipeline(batches, strategy, emb.prefetch) if pipelined else batches
    losses, pinned = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for features in loop:
            pinned.append(cache.pinned)  # rows held before this step's forward
            losses.append(_step(emb, features))
    out = {
        "losses": losses,
        "pinned": pinned,
        "pinned_after": cache.pinned,
        "warnings": [str(w.message) for w in caught if "read in their own step" in str(w.message)],
        **snapshot(emb),
    }
    strategy.teardown()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_rows_read_ahead_train_like_the_plain_loop(tmp_path: Path, world: int) -> None:
    plain = run_distributed(_train, world, args=(str(tmp_path / "plain"), False, 120), timeout=90)
    piped = run_distributed(_train, world, args=(str(tmp_path / "piped"), True, 120), timeout=90)
    for rank in range(world):
        assert piped[rank]["losses"] == plain[rank]["losses"]
        assert piped[rank]["step"] == plain[rank]["step"]
        for name, table in plain[rank]["tables"].items():
            assert torch.equal(piped[rank]["tables"][name], table), name
        for name, state in plain[rank]["state"].items():
            for key, value in state.items():
                assert torch.equal(piped[rank]["state"][name][key], value), (name, key)
        # a plain step starts with nothing pinned; a pipelined one with its own rows and the
        # next batch's read in already (all but the last); nothing stays pinned at the end
        assert plain[rank]["pinned"] == [0] * STEPS
        assert all(p > 0 for p in piped[rank]["pinned"]), piped[rank]["pinned"]
        assert piped[rank]["pinned_after"] == plain[rank]["pinned_after"] == 0
        assert not piped[rank]["warnings"]


@pytest.mark.timeout(120)
def test_a_cache_too_small_for_two_batches_reads_in_the_step(tmp_path: Path) -> None:
    """Room for one batch's rows, not two: the prefetch leaves them to the step, says so once,
    and the numbers do not change."""
    plain = run_distributed(_train, 2, args=(str(tmp_path / "plain"), False, 40), timeout=90)
    piped = run_distributed(_train, 2, args=(str(tmp_path / "piped"), True, 40), timeout=90)
    said = [len(result["warnings"]) for result in piped]
    assert max(said) == 1, said
    message = next(w for result in piped for w in result["warnings"])
    assert "batches' rows are read in their own step from now on, not ahead: disk tier: " in message
    assert "raise DiskTier(cache_rows=...) to at least" in message
    for rank in range(2):
        assert piped[rank]["losses"] == plain[rank]["losses"]
        for name, table in plain[rank]["tables"].items():
            assert torch.equal(piped[rank]["tables"][name], table), name
        assert piped[rank]["pinned_after"] == 0


def _drop_and_checkpoint(directory: str) -> dict[str, Any]:
    """Two steps pipelined, a checkpoint with batch 2 in flight, then drop it (unpinned); a
    fresh collection loads the checkpoint and runs batches 2.. plainly, as the first goes on
    through a new pipeline: both end alike."""
    strategy = mp.ManualParallelStrategy()
    rank = strategy.rank
    emb = build(strategy, "rowwise", DiskTier(f"{directory}/a", cache_rows=120))
    cache = emb.storage.by_name["big"].cache
    state = {"model": emb, **extra_checkpoint_entries(emb)}
    pipeline = mp.TrainPipeline(_batches(rank, range(STEPS)), strategy, emb.prefetch)
    for step, features in enumerate(pipeline):
        _step(emb, features)
        if step == 1:
            break  # batch 2 is held, its rows read in and pinned
    held = cache.pinned
    strategy.save_checkpoint(f"{directory}/ckpt", state)
    emb.drop_prefetched()
    dropped = cache.pinned
    for features in mp.TrainPipeline(_batches(rank, range(2, STEPS)), strategy, emb.prefetch):
        _step(emb, features)
    fresh = build(strategy, "rowwise", DiskTier(f"{directory}/b", cache_rows=120))
    strategy.load_checkpoint(
        f"{directory}/ckpt", {"model": fresh, **extra_checkpoint_entries(fresh)}
    )
    for features in _batches(rank, range(2, STEPS)):
        _step(fresh, features)
    # loading into a collection with a batch in flight forgets the batch (its rows were read
    # before the load), and its forward runs whole on the loaded rows
    again = build(strategy, "rowwise", DiskTier(f"{directory}/c", cache_rows=120))
    for _ in mp.TrainPipeline(_batches(rank, range(STEPS)), strategy, again.prefetch):
        break  # batches 0 and 1 held, their rows pinned
    state = {"model": again, **extra_checkpoint_entries(again)}
    strategy.load_checkpoint(f"{directory}/ckpt", state)
    after_load = (again.batches_in_flight, again.storage.by_name["big"].cache.pinned)
    for features in _batches(rank, range(2, STEPS)):
        _step(again, features)
    out = {
        "held": held,
        "dropped": dropped,
        "after_load": after_load,
        "went_on": snapshot(emb),
        "resumed": snapshot(fresh),
        "loaded_in_flight": snapshot(again),
    }
    strategy.teardown()
    return out


@pytest.mark.timeout(120)
def test_a_checkpoint_in_flight_resumes_exactly_and_a_dropped_batch_unpins(
    tmp_path: Path,
) -> None:
    results = run_distributed(_drop_and_checkpoint, 2, args=(str(tmp_path),), timeout=90)
    for result in results:
        assert result["held"] > 0 and result["dropped"] == 0
        assert result["after_load"] == (0, 0)
        went_on = result["went_on"]
        for other in (result["resumed"], result["loaded_in_flight"]):
            assert went_on["step"] == other["step"]
            for name, table in went_on["tables"].items():
                assert torch.equal(other["tables"][name], table), name


class _LoaderBroke(ValueError):
    pass


def _batches_then_error(rank: int, fail_at: int) -> Iterator[SparseFeatures]:
    for step in range(STEPS):
        if rank == 1 and step == fail_at:
            raise _LoaderBroke(f"rank {rank}: the loader broke at batch {step}")
        yield batch(rank, step, "zipf")


def _loader_error(directory: str, fail_at: int) -> dict[str, Any]:
    """Rank 1's loader raises while batch fail_at - 1 is in flight, its rows pinned: every rank
    leaves the loop after the same batch, rank 1 with its own error; nothing stays pinned or
    in flight, and the collection trains on (a plain step, the same on both ranks)."""
    strategy = mp.ManualParallelStrategy()
    emb = build(strategy, "rowwise", DiskTier(directory, cache_rows=120))
    cache = emb.storage.by_name["big"].cache
    pipeline = mp.TrainPipeline(_batches_then_error(strategy.rank, fail_at), strategy, emb.prefetch)
    steps, error = 0, None
    try:
        for features in pipeline:
            _step(emb, features)
            steps += 1
    except Exception as raised:  # the loop's own error, as a user's loop sees it
        error = (type(raised).__name__, str(raised), traceback.format_exc())
    out = {
        "steps": steps,
        "error": error,
        "pinned": cache.pinned,
        "in_flight": emb.batches_in_flight,
    }
    _step(emb, batch(strategy.rank, STEPS, "zipf"))
    out["pinned_after_step"] = cache.pinned
    strategy.teardown()
    return out


@pytest.mark.timeout(120)
def test_a_loader_error_with_rows_pinned_reaches_the_loop_and_leaves_nothing_pinned(
    tmp_path: Path,
) -> None:
    results = run_distributed(_loader_error, 2, args=(str(tmp_path), 3), timeout=90)
    assert [r["steps"] for r in results] == [3, 3]  # batches 0..2 on every rank
    own_type, own_message, own_traceback = results[1]["error"]
    assert (own_type, own_message) == ("_LoaderBroke", "rank 1: the loader broke at batch 3")
    assert "_batches_then_error" in own_traceback  # raised from the loader's own frame
    other_type, other_message, _ = results[0]["error"]
    assert other_type == "DataError"
    assert "the loader of rank 1 raised after 3 batches" in other_message
    for result in results:
        assert result["pinned"] == 0 and result["in_flight"] == 0
        assert result["pinned_after_step"] == 0
