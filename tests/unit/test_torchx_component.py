"""The torchx component `manualpar.run_script`: the command it builds, its argument checks, its
registration. Launching it for real is in tests/e2e/test_torchx_launch.py."""

from __future__ import annotations

import sys

import pytest

from manualpar.cli.torchx_component import run_script
from manualpar.errors import ConfigError


def test_component_builds_a_torchrun_command() -> None:
    app = run_script("--lr", "0.1", script="train.py", j="1x4", max_restarts=2)
    role = app.roles[0]
    assert role.entrypoint == sys.executable
    assert role.args == [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "2",
        "--standalone",
        "train.py",
        "--lr",
        "0.1",
    ]
    multi = run_script(m="pkg.train", j="3x8").roles[0]
    assert multi.entrypoint == "bash" and multi.num_replicas == 3
    assert "--nnodes 3" in multi.args[1] and "-m pkg.train" in multi.args[1]
    assert "${rank0_env}:=localhost}:29500" in multi.args[1]


def test_component_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="pass exactly one of --script and -m"):
        run_script()
    with pytest.raises(ConfigError, match=r"-j must look like NODESxPROCS \(e\.g\. 1x2\), got '2'"):
        run_script(script="a.py", j="2")
    with pytest.raises(ConfigError, match="at least 1 node and 1 process per node, got '0x2'"):
        run_script(script="a.py", j="0x2")


def test_registered_next_to_torchx_builtins() -> None:
    from torchx.specs.finder import get_components

    names = set(get_components())
    assert {"manualpar.run_script", "dist.ddp", "utils.echo"} <= names
