"""docs/api.md is what docs/gen_api.py writes from the code: every public name, with its
current signature. After a change to the public API: python docs/gen_api.py, then commit."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest

GENERATOR = Path(__file__).resolve().parents[2] / "docs" / "gen_api.py"


def _generator() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_is_on_the_api_page() -> None:
    gen = _generator()
    page = gen.PAGE.read_text()
    missing = [
        f"{module.__name__}.{name}"
        for module in gen.public_modules()
        for name in module.__all__
        if f"`{module.__name__}.{name}`" not in page
    ]
    assert missing == [], f"not on docs/api.md: {missing}; run {gen.COMMAND}"


def test_the_api_page_is_up_to_date() -> None:
    gen = _generator()
    assert gen.main(["--check"]) == 0, f"docs/api.md is out of date: run {gen.COMMAND}"


def test_the_check_sees_a_changed_signature(tmp_path: Path) -> None:
    gen = _generator()
    page = gen.render()
    assert "    plan: EmbeddingPlan | Mapping[str, TablePlacement] | str = 'auto',\n" in page
    stale = tmp_path / "api.md"
    stale.write_text(page.replace("str = 'auto',", "str = 'table_wise',", 1))
    gen.PAGE = stale
    assert gen.main(["--check"]) == 1


def test_a_module_exported_by_a_public_module_is_documented(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sub-package exported from the top (`mp.metrics`, say) gets its own section."""
    import manualpar

    extra = types.ModuleType("manualpar.extra", "Extra things.")
    extra.exact = lambda scores: scores  # type: ignore[attr-defined]
    extra.exact.__doc__ = "The exact value."  # type: ignore[attr-defined]
    extra.__all__ = ["exact"]  # type: ignore[attr-defined]
    monkeypatch.setattr(manualpar, "extra", extra, raising=False)
    monkeypatch.setattr(manualpar, "__all__", [*manualpar.__all__, "extra"])
    page = _generator().render()
    assert "## manualpar.extra\n\nExtra things.\n" in page
    assert (
        "### `manualpar.extra.exact`\n\n```python\nexact(scores)\n```\n\nThe exact value." in page
    )
