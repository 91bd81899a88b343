"""docs/launch.md's `plan` example on three tables (the plan, its predictions and the two
refusals) is what the CLI prints today: each `$ python -m manualpar plan ...` command of the
page's block runs in-process and its output is compared line by line. (The planner's picks
had moved twice since the page was written, with nothing to say so.)"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from manualpar.cli import main

PAGE = Path(__file__).resolve().parents[2] / "docs" / "launch.md"
FIRST = "$ python -m manualpar plan --world-size 4 --table user:50000000:128"
JSON = "runs/plan-demo.json"


def _sessions() -> list[tuple[list[str], list[str]]]:
    """The block's commands (continued over lines ending in a backslash), each with the lines
    it printed; `echo $?` is kept as a command whose line is the previous exit code."""
    text = PAGE.read_text()
    start = text.index(FIRST)
    lines = text[start : text.index("```", start)].splitlines()
    sessions: list[tuple[list[str], list[str]]] = []
    command = ""
    for line in lines:
        if command.endswith("\\"):
            command = command[:-1] + line.strip()
            if not line.endswith("\\"):
                sessions.append((shlex.split(command), []))
        elif line.startswith("$ "):
            command = line[2:]
            if not command.endswith("\\"):
                sessions.append((shlex.split(command), []))
        elif line and sessions:
            sessions[-1][1].append(line)
    return sessions


def test_the_pages_plan_example_is_the_clis_output(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    sessions = _sessions()
    assert len(sessions) == 4  # the plan, the budget refusal, its exit code, a bad --table
    written = str(tmp_path / "plan-demo.json")
    code = 0
    for argv, expected in sessions:
        if argv == ["echo", "$?"]:
            assert expected == [str(code)]
            continue
        assert argv[:3] == ["python", "-m", "manualpar"], argv
        code = main([written if a == JSON else a for a in argv[3:]])
        out = capsys.readouterr()
        printed = (out.out + out.err).replace(written, JSON).splitlines()
        assert printed == expected, " ".join(argv)
