"""The public API's rule (manualpar/__init__.py): what the top level and manualpar.embeddings
carry, that the command line uses nothing else, and that deprecated spellings still work and
say what replaces them."""

from __future__ import annotations

import ast
import importlib
import inspect
import warnings
from pathlib import Path

import pytest

import manualpar
import manualpar.embeddings as emb
from manualpar import errors, testing
from manualpar.deprecated import DEPRECATED, LEFT_THE_EMBEDDINGS_FACE
from manualpar.embeddings import planning

CLI = Path(manualpar.__file__).parent / "cli"
PUBLIC = {
    "manualpar": set(manualpar.__all__),
    "manualpar.embeddings": set(emb.__all__),
    "manualpar.embeddings.planning": set(planning.__all__),
    "manualpar.testing": set(testing.__all__),
}


@pytest.mark.parametrize("module", [manualpar, emb, planning], ids=lambda m: m.__name__)
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
        "UpdateRule",
        "DiskTier",
        "table_wise",
        "row_wise",
        "column_wise",
        "table_row_wise",
        "data_parallel",
        "HashIds",
        "ManagedCollisions",
        "planning",
    ]:
        assert name in emb.__all__, name
    assert len(emb.__all__) <= 40  # the face a model author holds
    for name in ["plan_tables", "plan_uniform", "plan_collections", "Workload", "Topology"]:
        assert name in planning.__all__, name


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


# the command line's own old spellings (`plan --optimizer`) warn from where every old spelling does
WARNS = ("manualpar.deprecated", "warn_deprecated")


def test_the_command_line_imports_only_public_names() -> None:
    internal = [
        f"{file}: from {module} import {name}"
        for file, module, name in _cli_imports()
        if not module.startswith("manualpar.cli")
        and not (module in PUBLIC and name in PUBLIC[module])
        and (module, name) != WARNS
    ]
    assert internal == []
    assert any(module == "manualpar.embeddings" for _, module, _ in _cli_imports())


def _one_table() -> emb.EmbeddingBagCollection:
    return emb.EmbeddingBagCollection([emb.EmbeddingBagConfig("t", 8, 4, ["f"])])


def test_normalize_by_world_still_works_and_names_its_replacement() -> None:
    strategy = manualpar.ManualParallelStrategy()
    with pytest.warns(FutureWarning) as caught:
        sharded = emb.shard_embeddings(
            _one_table(), strategy, rule=emb.SGD(lr=0.1), normalize_by="world"
        )
    assert sharded.normalize_by == "world_size"
    assert str(caught[0].message) == (
        'normalize_by="world" was renamed normalize_by="world_size" in manualpar 0.2; the old '
        "spelling still works but will be removed"
    )
    assert caught[0].filename == __file__  # the warning points at the caller's line


def test_fused_optimizer_optimizer_still_works_and_names_its_replacement() -> None:
    strategy = manualpar.ManualParallelStrategy()
    sharded = emb.shard_embeddings(_one_table(), strategy, rule=emb.SGD(lr=0.1))
    with pytest.warns(FutureWarning, match=r"FusedOptimizer\.rule"):
        rule = sharded.fused_optimizer.optimizer
    assert rule is sharded.fused_optimizer.rule
    assert {'normalize_by="world"', "FusedOptimizer.optimizer"} < set(DEPRECATED)


def _one_warning(get: object) -> tuple[object, str]:
    """What `get()` returns and the one FutureWarning it gave, pointing at this file."""
    with pytest.warns(FutureWarning) as caught:
        value = get()  # type: ignore[operator]
    assert len(caught) == 1 and caught[0].filename == __file__
    return value, str(caught[0].message)


@pytest.mark.parametrize("name", sorted(LEFT_THE_EMBEDDINGS_FACE))
def test_a_name_that_left_the_face_still_works_and_names_its_home(name: str) -> None:
    home = importlib.import_module(LEFT_THE_EMBEDDINGS_FACE[name])
    value, message = _one_warning(lambda: getattr(emb, name))
    assert value is getattr(home, name)
    assert name not in emb.__all__ and name not in vars(emb)
    assert message.startswith(f"manualpar.embeddings.{name} was renamed {home.__name__}.{name}")


def test_an_old_name_warns_once_per_call_site() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            emb.plan_tables  # noqa: B018 (the access is the test)
    assert len(caught) == 1


def test_an_unknown_name_is_an_attribute_error() -> None:
    assert not hasattr(emb, "no_such_name")
    with pytest.raises(ImportError, match="no_such_name"):
        from manualpar.embeddings import no_such_name  # type: ignore[attr-defined]  # noqa: F401


def test_renamed_classes_still_work_and_name_their_replacement() -> None:
    rule, message = _one_warning(lambda: emb.SparseOptimizer)
    assert rule is emb.UpdateRule and message.startswith("SparseOptimizer was renamed UpdateRule")
    for module in (manualpar, manualpar.loop):
        read_ahead, message = _one_warning(lambda: module.Prefetched)  # noqa: B023
        assert read_ahead is manualpar.ReadAhead
        assert message.startswith("Prefetched was renamed ReadAhead")


def test_on_disk_the_function_still_works_and_names_the_keyword() -> None:
    on_disk, message = _one_warning(lambda: emb.on_disk)
    assert on_disk(emb.row_wise()) == emb.row_wise(on_disk=True)  # type: ignore[operator]
    assert on_disk(emb.table_wise(1)) == emb.table_wise(1, on_disk=True)  # type: ignore[operator]
    assert message.startswith("on_disk(placement) was renamed row_wise(..., on_disk=True)")
    assert emb.row_wise(on_disk=True).on_disk and not emb.row_wise().on_disk


def test_shard_embeddings_optimizer_still_works_and_names_rule() -> None:
    strategy = manualpar.ManualParallelStrategy()
    sharded, message = _one_warning(
        lambda: emb.shard_embeddings(_one_table(), strategy, optimizer=emb.SGD(lr=0.3))
    )
    assert sharded.fused_optimizer.rule == emb.SGD(lr=0.3)  # type: ignore[attr-defined]
    assert "rule=SGD(lr=0.3)" in repr(sharded) and "optimizer=" not in repr(sharded)
    assert message.startswith("shard_embeddings(optimizer=...) was renamed shard_embeddings(rule=")
    with pytest.raises(manualpar.ConfigTypeError, match="pass rule= alone"):
        emb.shard_embeddings(
            _one_table(), strategy, rule=emb.SGD(lr=0.1), optimizer=emb.SGD(lr=0.1)
        )


def test_trainer_prefetch_still_works_and_names_read_ahead(tmp_path: Path) -> None:
    strategy = manualpar.ManualParallelStrategy()
    trainer, message = _one_warning(
        lambda: manualpar.Trainer(strategy, tmp_path, max_steps=1, prefetch=True)
    )
    assert trainer.read_ahead is True  # type: ignore[attr-defined]
    assert message.startswith("Trainer(prefetch=...) was renamed Trainer(read_ahead=...)")
    assert manualpar.Trainer(strategy, tmp_path, max_steps=1, read_ahead=True).read_ahead
    assert not manualpar.Trainer(strategy, tmp_path, max_steps=1).read_ahead


def test_the_planners_optimizer_still_works_and_names_rule() -> None:
    tables = [emb.EmbeddingBagConfig("t", 8, 4, ["f"]), emb.EmbeddingBagConfig("u", 6, 4, ["g"])]
    adam = emb.Adam(lr=0.1)
    new = planning.plan_tables(tables, 2, rule=adam, price="memory")
    old, message = _one_warning(
        lambda: planning.plan_tables(tables, 2, optimizer=adam, price="memory")
    )
    assert old == new and message.startswith("plan_tables(optimizer=...) was renamed plan_tables(")
    towers = {"a": tables[:1], "b": tables[1:]}
    old, message = _one_warning(lambda: planning.plan_collections(towers, 2, optimizer=adam))
    assert old == planning.plan_collections(towers, 2, rule=adam)
    assert message.startswith("plan_collections(optimizer=...) was renamed plan_collections(")
    old, message = _one_warning(
        lambda: planning.plan_uniform("table_wise", tables, 2, optimizer=adam)
    )
    assert old == planning.plan_uniform("table_wise", tables, 2, rule=adam)
    assert message.startswith("plan_uniform(optimizer=...) was renamed plan_uniform(rule=...)")
    for both in (
        lambda: planning.plan_tables(tables, 2, rule=adam, optimizer=adam),
        lambda: planning.plan_collections(towers, 2, rule=adam, optimizer=adam),
        lambda: planning.plan_uniform("row_wise", tables, 2, rule=adam, optimizer=adam),
    ):
        with pytest.raises(manualpar.ConfigTypeError, match="pass rule= alone"):
            both()
