"""The documented way to read a sharded table's values (docs/embeddings-storage.md, "Reading a
sharded table's values") runs as written on one process and gives the table's plain values."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "embeddings-storage.md"
MARKER = "<!-- test: tests/unit/test_emb_sharded_full_tensors_doc.py runs this block -->"


def _documented_block() -> str:
    text = DOC.read_text()
    assert MARKER in text, "the documented example moved: keep the marker above its block"
    found = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], re.DOTALL)
    assert found is not None
    return found.group(1)


def test_the_documented_full_tensors_example_runs_and_gives_plain_tables(
    capsys: pytest.CaptureFixture[str],
) -> None:
    namespace: dict = {}
    exec(compile(_documented_block(), str(DOC), "exec"), namespace)  # the doc, as written
    table, emb = namespace["weights"]["tables.item.weight"], namespace["emb"]
    assert type(table) is torch.Tensor and table.shape == (10, 4)
    assert torch.equal(table, emb.tables["item"].weight.detach())
    with pytest.raises(NotImplementedError, match=r"use full_tensors\(\) for a gathered tensor"):
        namespace["sharded"] * 2  # the escape is needed: the sharded value refuses arithmetic
    assert set(namespace["optim"]) >= {"lr", "state"}
    assert capsys.readouterr().out.startswith("LocalShards (10, 4) ")
