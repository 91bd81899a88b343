"""docs/trainer-options.md is the reference of every Trainer option: each keyword of
Trainer.__init__ has an entry there, and the Trainer's docstring (docs/api.md's line for it)
points at the page."""

from __future__ import annotations

import inspect
from pathlib import Path

import manualpar as mp

PAGE = Path(__file__).resolve().parents[2] / "docs" / "trainer-options.md"
RENAMED = {"prefetch": "read_ahead"}  # old spellings: named in their new name's entry


def test_every_trainer_option_has_an_entry_on_the_options_page() -> None:
    page = PAGE.read_text()
    names = [n for n in inspect.signature(mp.Trainer.__init__).parameters if n != "self"]
    missing = [n for n in names if n not in RENAMED and f"- **`{n}`**" not in page]
    assert missing == [], f"no entry on {PAGE.name}: {missing}"
    for old, new in RENAMED.items():
        entry = page[page.index(f"- **`{new}`**") :].split("\n- ")[0]
        assert f"`{old}=`" in entry
    assert len(page.splitlines()) < 500


def test_the_trainer_docstring_points_at_the_options_page() -> None:
    doc = inspect.getdoc(mp.Trainer) or ""
    assert "docs/trainer-options.md" in doc.split("\n\n")[0]  # the API page's summary line
