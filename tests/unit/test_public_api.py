"""The public API's rule (manualpar/__init__.py): what the top level and manualpar.embeddings
carry, that the command line uses nothing else, and that deprecated spellings still work and
say what replaces them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import manualpar
import manualpar.embeddings as emb
from manualpar import errors, testing
from manualpar.deprecated import DEPRECATED

CLI = Path(manualpar.__file__).parent / "cli"
PUBLIC = {
    "manualpar": set(manualpar.__all__),
    "manualpar.embeddings": set(emb.__all__),
    "manualpar.testing": set(testing.__all__),
}


@pytest.mark.parametrize("module", [manualpar, emb], ids=lambda m: m.__name__)
def test_every_exported_name_exists(module: object) -> None:
    missing = [name for name in module.__all__ if not hasattr(module, name)]  # type: ignore[attr-defined]
    assert missing == []


def test_every_error_class_is_exported_at_the_top() -> None:
    classes = {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value)
        and issubclass(value, Exception)
        and value.__module__ == errors.__name__
    }
    assert classes - set(manualpar.__all__) == set()
    assert "MeshError" in classes


def test_the_top_level_carries_the_strategy_builders_loop_and_checkpoint_functions() -> None:
    for name in [
        "ManualParallelStrategy",
        "ParallelModule",
        "load_trained",
        "ddp",
        "fsdp",
        "tp",
        "zero_optimizer",
        "empty_init",
        "materialize",
        "Trainer",
        "save_checkpoint",
        "save_checkpoint_async",
        "load_checkpoint",
        "latest_checkpoint",
        "full_tensors",
    ]:
        assert name in manualpar.__all__, name


def test_embeddings_carry_their_vocabulary() -> None:
    for name in [
        "SGD",
        "Adagrad",
        "Adam",
        "RowWiseAdagrad",
        "plan_tables",
        "plan_uniform",
        "plan_collections",
        "DiskTier",
        "table_wise",
        "row_wise",
        "column_wise",
        "table_row_wise",
        "data_parallel",
        "on_disk",
        "full_tensors",
        "HashIds",
        "ManagedCollisions",
    ]:
        assert name in emb.__all__, name


def _cli_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every `from manualpar... import name` in manualpar/cli/."""
    found = []
    for path in sorted(CLI.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("manualpar"):
                found += [(path.name, node.module or "", a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [
                    (path.name, a.name, "") for a in node.names if a.name.startswith("manualpar")
                ]
    return found


def test_the_command_line_imports_only_public_names() -> None:
    internal = [
        f"{file}: from {module} import {name}"
        for file, module, name in _cli_imports()
        if not module.startswith("manualpar.cli")
        and not (module in PUBLIC and name in PUBLIC[module])
    ]
    assert internal == []
    assert any(module == "manualpar.embeddings" for _, module, _ in _cli_imports())


def _one_table() -> emb.EmbeddingBagCollection:
    return emb.EmbeddingBagCollection([emb.EmbeddingBagConfig("t", 8, 4, ["f"])])


def test_normalize_by_world_still_works_and_names_its_replacement() -> None:
    strategy = manualpar.ManualParallelStrategy()
    with pytest.warns(FutureWarning) as caught:
        sharded = emb.shard_embeddings(
            _one_table(), strategy, optimizer=emb.SGD(lr=0.1), normalize_by="world"
        )
    assert sharded.normalize_by == "world_size"
    assert str(caught[0].message) == (
        'normalize_by="world" was renamed normalize_by="world_size" in manualpar 0.2; the old '
        "spelling still works but will be removed"
    )
    assert caught[0].filename == __file__  # the warning points at the caller's line


def test_fused_optimizer_optimizer_still_works_and_names_its_replacement() -> None:
    strategy = manualpar.ManualParallelStrategy()
    sharded = emb.shard_embeddings(_one_table(), strategy, optimizer=emb.SGD(lr=0.1))
    with pytest.warns(FutureWarning, match=r"FusedOptimizer\.rule"):
        rule = sharded.fused_optimizer.optimizer
    assert rule is sharded.fused_optimizer.rule
    assert set(DEPRECATED) == {'normalize_by="world"', "FusedOptimizer.optimizer"}
