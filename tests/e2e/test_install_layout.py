"""The install works from the folder above a clone named manualpar/ (a common checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_import_from_the_parent_of_a_clone_named_manualpar(tmp_path: Path) -> None:
    # The folder holding a clone named manualpar/ is the working directory (sys.path[0] for
    # `python -c`): the installed package must win over that folder as a namespace package.
    (tmp_path / "manualpar").symlink_to(REPO, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the install alone
    result = subprocess.run(
        [sys.executable, "-c", "import manualpar; print(manualpar.ParallelModule.__name__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ParallelModule"
