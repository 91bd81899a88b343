"""bench_embeddings.py's command line (no job started here: a mode that ran would fail)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from example_modules import load_example

bench = load_example(Path("benchmarks/bench_embeddings.py"), "bench_embeddings_args")


@pytest.mark.parametrize("mode", ["--scale", "--precision"])
def test_baseline_src_with_another_mode_is_an_argument_error(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Refused at parsing (exit 2, with the usage), not once the mode's first jobs ran."""
    import embedding_precision
    import embedding_scale

    def ran(args: object) -> dict:
        raise AssertionError(f"{mode} ran before --baseline-src was refused")

    monkeypatch.setattr(embedding_scale, "scale", ran)
    monkeypatch.setattr(embedding_precision, "precision", ran)
    (tmp_path / "manualpar").mkdir()
    (tmp_path / "manualpar" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "argv", ["bench_embeddings.py", mode, "--baseline-src", str(tmp_path)])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2
    assert "--baseline-src runs in the default mode" in capsys.readouterr().err
