"""Import a file of examples/ in a test under a unique module name.

The example scripts import their siblings by plain name (`import data`); loading one here under
a name of its own (e.g. "recsys_data") keeps it from clashing with another example's `data`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(
    path: Path, name: str, siblings: dict[str, ModuleType] | None = None
) -> ModuleType:
    """The module at `path` (absolute, or relative to examples/), registered as `name`.
    `siblings` are the modules its plain imports (`from data import ...`) get: bound under those
    names only while it loads, then whatever was there before is restored."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    siblings = siblings or {}
    before = {sibling: sys.modules.get(sibling) for sibling in siblings}
    sys.modules.update(siblings)
    try:
        spec.loader.exec_module(module)
    finally:
        for sibling, previous in before.items():
            if previous is None:
                del sys.modules[sibling]
            else:
                sys.modules[sibling] = previous
    return module
