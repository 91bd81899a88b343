"""The disk tier on real gloo ranks: a table 8x its cache trains to exactly the in-memory
numbers, checkpoints move between tiers and world sizes, a kill mid write-back loses nothing
committed, and a cache too small for a step says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from disk_tier_cases import (
    die_in_write_back,
    load_after_kill,
    resharded_phase,
    too_small_cache,
    train_pair,
)

from manualpar.testing import run_distributed


def assert_same(actual: dict, expected: dict) -> None:
    """Tables and optimizer state equal bit for bit."""
    assert actual["step"] == expected["step"]
    for name, tensor in expected["tables"].items():
        assert torch.equal(actual["tables"][name], tensor), name
    for table, keys in expected["state"].items():
        for key, tensor in keys.items():
            assert torch.equal(actual["state"][table][key], tensor), (table, key)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("world", "opt", "ids", "write_log"),
    [
        (2, "rowwise", "uniform", 4.0),  # the default log
        (2, "adam", "zipf", 0.0),  # no log: evicted rows go to their places
        (3, "rowwise", "zipf", 0.5),  # a small log: drained when full, mid-training
        (3, "adam", "uniform", 4.0),
    ],
)
def test_disk_table_trains_to_the_in_memory_numbers(
    tmp_path: Path, world: int, opt: str, ids: str, write_log: float
) -> None:
    results = run_distributed(
        train_pair,
        world,
        args=(str(tmp_path / "tier"), opt, ids, 6, torch.float32, write_log),
        timeout=60,
    )
    for result in results:
        assert_same(result["disk"], result["memory"])
        # the cache really cycled: more rows fetched than it holds
        assert result["misses"] > result["capacity"]
        appended, drains, logged = result["logged"]
        assert result["log_rows"] == min(int(write_log * result["capacity"]), -(-960 // world))
        if write_log == 0:
            assert (appended, drains, logged) == (0, 0, 0)
        else:  # rows were in the log when the snapshot drained it
            assert appended > 0 and logged > 0
            assert drains > 0 if write_log < 1 else drains == 0, (appended, result["log_rows"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("dtype", "opt", "native"),
    [
        (torch.float16, "rowwise", "1"),
        (torch.bfloat16, "rowwise", "1"),
        (torch.bfloat16, "adam", "1"),
        (torch.float32, "rowwise", "0"),  # the torch path: a row sums its bags in order
        (torch.bfloat16, "adam", "0"),
    ],
)
def test_half_rows_and_torch_path_on_disk(
    tmp_path: Path, dtype: torch.dtype, opt: str, native: str
) -> None:
    """Half rows on disk train to the in-memory bits: float16 rounds to nearest, bfloat16
    stochastically with the bits of each element's table position (not of its cache slot);
    on the C++ kernels and on the torch path (CUDA, no compiler) alike."""
    results = run_distributed(
        train_pair,
        2,
        args=(str(tmp_path / "tier"), opt, "zipf", 4, dtype),
        timeout=60,
        env={"MANUALPAR_NATIVE_KERNELS": native},
    )
    for result in results:
        assert result["disk"]["tables"]["big"].dtype == dtype
        assert_same(result["disk"], result["memory"])
        assert result["misses"] > result["capacity"]


@pytest.mark.timeout(120)
def test_checkpoints_cross_tiers_and_world_sizes(tmp_path: Path) -> None:
    """2 ranks -> 1 -> 3, each phase loading the other tier's checkpoint of the last one."""
    saved = [(str(tmp_path / f"memory{i}"), str(tmp_path / f"disk{i}")) for i in range(3)]
    loads = [None, saved[0], saved[1]]
    for phase, (world, steps) in enumerate(((2, range(0, 3)), (1, range(3, 5)), (3, range(5, 6)))):
        results = run_distributed(
            resharded_phase,
            world,
            args=(str(tmp_path / f"phase{phase}"), "adam", loads[phase], steps, saved[phase]),
            timeout=60,
        )
        for result in results:
            assert_same(result["disk"], result["memory"])
    assert results[0]["disk"]["step"] == 6


@pytest.mark.timeout(90)
def test_kill_in_write_back_keeps_the_committed_checkpoint(tmp_path: Path) -> None:
    directory, checkpoint = str(tmp_path / "tier"), str(tmp_path / "ckpt")
    outcomes = run_distributed(
        die_in_write_back,
        2,
        args=(directory, checkpoint),
        timeout=60,
        allow_failure=True,
    )
    assert not outcomes[1].ok and outcomes[1].exitcode == -9  # SIGKILL, mid write-back
    results = run_distributed(load_after_kill, 2, args=(directory, checkpoint), timeout=60)
    for result in results:
        assert_same(result["disk"], result["memory"])


@pytest.mark.timeout(60)
def test_a_cache_smaller_than_a_step_names_table_rank_and_fix(tmp_path: Path) -> None:
    messages = run_distributed(too_small_cache, 2, args=(str(tmp_path),), timeout=45)
    for rank, message in enumerate(messages):
        # CacheTooSmall: an EmbeddingInputError of its own (a pipeline's prefetch catches it)
        assert message.startswith(f"CacheTooSmall: disk tier: table 'big' on rank {rank} needs "), (
            message
        )
        assert message.endswith(
            "distinct rows in its cache at once (this step's rows, with those of a batch "
            "prefetched ahead if any), but the cache holds 4 rows; raise "
            "DiskTier(cache_rows=...) to at least "
            + message.split("at least ")[1].split(" ")[0]
            + " (or cache_bytes=...), or use smaller batches"
        )
        needed = int(message.split(" needs ")[1].split(" ")[0])
        assert needed > 4
