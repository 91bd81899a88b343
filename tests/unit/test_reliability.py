"""Bad inputs and faults the other test files do not cover: non-finite data (opt-in check), a full
disk, an unwritable directory, a checkpoint of other table sizes, a file that is not a
checkpoint, a bad timeout variable. Collectives called with different shapes on different ranks
are in tests/dist/test_collective_shapes.py.

Each case asserts the exception type, the key parts of the message, and that nothing was lost:
the previous checkpoint still loads. docs/reliability.md lists every case with its node id.
"""

from __future__ import annotations

import ast
import errno
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_models import make_model
from faults import assert_first_checkpoint_intact, reference_after_one_step

import manualpar as mp
import manualpar.checkpoint.save as checkpoint
from manualpar.embeddings import SGD, EmbeddingBagCollection, EmbeddingBagConfig, SparseFeatures
from manualpar.embeddings import shard_embeddings as shard
from manualpar.errors import ClusterEnvironmentError


def _raises(error: type[Exception], *parts: str) -> pytest.RaisesContext:
    """pytest.raises matching every literal fragment, in order."""
    return pytest.raises(error, match=".*".join(re.escape(p) for p in parts))


# ---- non-finite inputs: opt-in check_finite ----------------------------------------------------
def test_nan_in_a_dense_batch_names_the_tensor_count_and_first_index() -> None:
    dense = torch.ones(4, 3)
    dense[2, 1] = float("nan")
    dense[3, 0] = float("inf")
    batch = {"ids": torch.tensor([1, 2]), "dense": [torch.zeros(2), dense]}
    with _raises(
        mp.NonFiniteError,
        "batch['dense'][1]: 2 non-finite value(s) (1 NaN, 1 inf) in "
        "a torch.float32 tensor of shape (4, 3); the first is nan at index (2, 1). Fix "
        "or drop this input",
    ):
        mp.check_finite(batch, where="batch")


def test_infinite_loss_and_sparse_weights() -> None:
    with _raises(mp.NonFiniteError, "loss at step 7: 1 non-finite value(s) (0 NaN, 1 inf)"):
        mp.check_finite(torch.tensor(float("inf")), where="loss at step 7")
    sparse = SparseFeatures(
        ("user",), torch.tensor([1, 2]), torch.tensor([1, 1]), torch.tensor([0.5, float("nan")])
    )
    with _raises(
        mp.NonFiniteError,
        "batch['sparse'].weights: 1 non-finite value(s) (1 NaN, 0 inf)",
        "the first is nan at index (1,)",
    ):
        mp.check_finite({"sparse": sparse}, where="batch")


def test_finite_values_pass_through_unchanged() -> None:
    batch = {"x": torch.randn(3, 2), "ids": torch.tensor([1]), "name": "a", "n": 3}
    assert mp.check_finite(batch, where="batch") is batch


def test_non_finite_error_is_caught_as_a_value_error() -> None:
    """Code that guards its input with `except ValueError` catches the check's refusal."""
    batch = {"x": torch.tensor([1.0, float("nan")])}
    try:
        mp.check_finite(batch, where="batch")
    except ValueError as error:
        caught = (type(error).__name__, str(error))
    else:
        caught = ("no error", "")
    assert caught == (
        "NonFiniteError",
        "batch['x']: 1 non-finite value(s) (1 NaN, 0 inf) in a torch.float32 tensor of shape "
        "(2,); the first is nan at index (1,). Fix or drop this input before it reaches the "
        "model (a NaN loss usually means a NaN input or too high a learning rate)",
    )


# ---- saving: a full disk, an unwritable directory ----------------------------------------------
def _committed(directory: Path) -> dict[str, Any]:
    """ckpt_a (step 1) as faults.save_twice (tests/support) commits it; the state to save next."""
    model = reference_after_one_step()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    mp.ManualParallelStrategy().save_checkpoint(directory / "ckpt_a", {"model": model, "step": 1})
    return {"model": model, "optim": optimizer, "step": 2}


def _disk_with_free_bytes(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    usage = shutil.disk_usage(".")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_full_disk_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: bool
) -> None:
    state = _committed(tmp_path)
    _disk_with_free_bytes(monkeypatch, 100)
    target = tmp_path / ("ckpt_b.pt" if full else "ckpt_b")
    with _raises(
        mp.CheckpointError,
        f"not enough disk space to save {target}: it needs about",
        f"but {tmp_path} has 0.0 MiB (100 bytes) free; delete old checkpoints or save elsewhere",
    ):
        mp.ManualParallelStrategy().save_checkpoint(target, state, full=full)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_a"]  # no partial copy either
    assert_first_checkpoint_intact(tmp_path)


def test_disk_filling_up_mid_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _committed(tmp_path)

    def no_space(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "write_file", no_space)  # the object files, after the tensors
    with _raises(
        mp.CheckpointError,
        f"save_checkpoint({tmp_path / 'ckpt_a'}): writing objects failed on rank 0: no space "
        f"left on device: could not write {tmp_path / '.ckpt_a.partial/objects/replicated.pt'} "
        "([Errno 28] No space left on device); free disk space (delete old checkpoints), or "
        "save elsewhere",
    ):
        mp.ManualParallelStrategy().save_checkpoint(tmp_path / "ckpt_a", state)  # an overwrite
    assert mp.latest_checkpoint(tmp_path) == tmp_path / "ckpt_a"
    assert_first_checkpoint_intact(tmp_path)


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_directory_that_cannot_be_created(tmp_path: Path, full: bool) -> None:
    # A parent that is a regular file blocks writes even for root, unlike chmod.
    (tmp_path / "runs").write_text("not a directory")
    target = tmp_path / "runs" / "ckpt"
    with _raises(
        mp.CheckpointError,
        f"cannot create checkpoint directory {tmp_path / 'runs'}:",
        "save under a directory you can write to",
    ):
        mp.ManualParallelStrategy().save_checkpoint(target, {"step": 1}, full=full)
    assert (tmp_path / "runs").read_text() == "not a directory"


# ---- loading: a checkpoint of another model, a file that is not one ----------------------------
def test_checkpoint_with_other_table_sizes(tmp_path: Path) -> None:
    strategy = mp.ManualParallelStrategy()

    def sharded(rows: int) -> Any:
        tables = [EmbeddingBagConfig("user", rows, 4), EmbeddingBagConfig("item", 6, 4)]
        return shard(EmbeddingBagCollection(tables), strategy, "auto", SGD(lr=0.1))

    saved = sharded(10)
    strategy.save_checkpoint(tmp_path / "c", {"model": saved})
    other = sharded(12)
    with _raises(
        mp.CheckpointMismatchError,
        f"checkpoint {tmp_path / 'c'} does not match the "
        "state being loaded; shape mismatches: model/tables.user.weight: checkpoint "
        "(10, 4) vs current (12, 4). It was probably saved from another model",
    ):
        strategy.load_checkpoint(tmp_path / "c", {"model": other})


def test_a_file_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with _raises(
        mp.CheckpointError, f"{tmp_path / 'notes.txt'} is corrupted, truncated or not a checkpoint"
    ):
        mp.ManualParallelStrategy().load_checkpoint(tmp_path / "notes.txt", {"step": 0})
    with _raises(mp.CheckpointError, f"{tmp_path / 'notes.txt'} is not a directory of checkpoints"):
        mp.latest_checkpoint(tmp_path / "notes.txt")


def test_a_plain_torch_file_is_not_taken_for_a_full_export(tmp_path: Path) -> None:
    torch.save(make_model(0).state_dict(), tmp_path / "weights.pt")
    with _raises(mp.CheckpointError, "is not a manualpar full checkpoint (no '__manualpar__')"):
        mp.ManualParallelStrategy().load_checkpoint(tmp_path / "weights.pt", {"step": 0})


# ---- security: nothing is unpickled from disk by manualpar's own code ---------------------------
def _calls(name: str) -> list[tuple[str, ast.Call]]:
    """Every call of `name` (e.g. "torch.load") in the manualpar package, with its file."""
    found = []
    for path in sorted(Path(mp.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == name:
                found.append((path.name, node))
    return found


def test_every_torch_load_is_weights_only_and_nothing_unpickles() -> None:
    loads = _calls("torch.load")
    assert loads, "the scan found no torch.load at all"
    for filename, call in loads:
        flags = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert flags.get("weights_only") == "True", f"{filename}: {ast.unparse(call)}"
    # The test helper unpickles only what its own child processes sent it.
    unpickled = [
        (f, ast.unparse(c))
        for name in ("pickle.load", "pickle.loads")
        for f, c in _calls(name)
        if f != "testing.py"
    ]
    assert unpickled == []


@pytest.mark.parametrize(
    ("raw", "error", "message"),
    [
        (
            "abc",
            ClusterEnvironmentError,
            "MANUALPAR_TIMEOUT_S='abc' is not a number of seconds; set it "
            "to e.g. 120 or unset it for the 5-minute default",
        ),
        ("-5", mp.ConfigError, "collective timeout must be positive, got -5 s; pass seconds > 0"),
    ],
    ids=["not_a_number", "negative"],
)
def test_bad_timeout_variable(raw, error, message, monkeypatch):
    from manualpar.strategy.timeouts import resolve_timeout

    monkeypatch.setenv("MANUALPAR_TIMEOUT_S", raw)
    with pytest.raises(error) as raised:
        resolve_timeout(None)
    assert str(raised.value).startswith(message)
