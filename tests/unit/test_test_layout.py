"""The test folders keep their promises: pytest collects each of them, and tests/unit starts no
process (no subprocess, no run_distributed, no launcher), so it runs alone in seconds."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = ("unit", "dist", "e2e")
# Modules and names that start processes, and where they come from.
PROCESS_STARTERS = {
    "subprocess": None,
    "multiprocessing": None,
    "launch": None,  # tests/support/launch.py: torchrun and plain-process jobs
    "torchx.runner": None,
    "manualpar.testing": {"run_distributed"},
}


def test_pytest_collects_every_test_folder(pytestconfig: pytest.Config) -> None:
    skipped = [
        (folder, pattern)
        for folder in FOLDERS
        for pattern in pytestconfig.getini("norecursedirs")
        if fnmatch.fnmatch(folder, pattern)
    ]
    assert skipped == [], "norecursedirs in pyproject.toml hides a test folder"
    assert all(any((TESTS / folder).glob("test_*.py")) for folder in FOLDERS)


def _starters(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in PROCESS_STARTERS]
        elif isinstance(node, ast.ImportFrom) and node.module in PROCESS_STARTERS:
            names = PROCESS_STARTERS[node.module]
            found += [
                f"{node.module}.{a.name}" for a in node.names if names is None or a.name in names
            ]
    return [f"{path.relative_to(TESTS)}:{name}" for name in found]


def test_unit_tests_start_no_process() -> None:
    found = [name for path in sorted((TESTS / "unit").glob("*.py")) for name in _starters(path)]
    assert found == [], "move these tests to tests/dist or tests/e2e"
    # the scan is not blind: it sees the process starters of the other folders
    assert _starters(TESTS / "dist" / "test_ddp.py") == [
        "dist/test_ddp.py:manualpar.testing.run_distributed"
    ]
    assert _starters(TESTS / "e2e" / "test_examples.py") == [
        "e2e/test_examples.py:launch.run_torchrun"
    ]


def test_test_file_names_are_unique_across_folders() -> None:
    """pytest imports test files by basename (no __init__.py): two folders holding the same name
    stop the whole suite at collection, which a run of one folder alone does not show."""
    seen: dict[str, list[str]] = {}
    for folder in FOLDERS:
        for path in (TESTS / folder).glob("test_*.py"):
            seen.setdefault(path.name, []).append(folder)
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}
