"""Launcher detection on plain dicts: no processes, no torch.distributed."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from manualpar.environment import (
    ClusterEnvironment,
    detect_environment,
    first_slurm_host,
    from_mpi,
    from_slurm,
    from_torchelastic,
    single_process,
)
from manualpar.errors import ClusterEnvironmentError, ManualParError

# --------------------------------------------------------------------------------------------
# Fixtures: one consistent environment per launcher, which the error tests then break.
# --------------------------------------------------------------------------------------------


def _torchrun(**overrides: str | None) -> dict[str, str]:
    """Worker 5 of 8: second node (GROUP_RANK=1) of two, 4 workers per node."""
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "job-42",
    }
    return _apply(env, overrides)


def _slurm(**overrides: str | None) -> dict[str, str]:
    """srun task 6 of 8: second node (SLURM_NODEID=1) of two, 4 tasks per node."""
    env = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "2",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "SLURM_NODELIST": "gpu[003-005,9],cpu1",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "train",
    }
    return _apply(env, overrides)


def _mpi(**overrides: str | None) -> dict[str, str]:
    """mpirun rank 6 of 8, local rank 2 of 4 on the second node."""
    env = {
        "OMPI_COMM_WORLD_RANK": "6",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "MASTER_ADDR": "head-node",
        "MASTER_PORT": "23456",
    }
    return _apply(env, overrides)


def _apply(env: dict[str, str], overrides: dict[str, str | None]) -> dict[str, str]:
    """Set the overrides; a value of None removes the variable."""
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _raises(pattern: str):
    """pytest.raises for ClusterEnvironmentError with a literal (escaped) message fragment."""
    return pytest.raises(ClusterEnvironmentError, match=re.escape(pattern))


# --------------------------------------------------------------------------------------------
# torchrun / torchelastic / torchx
# --------------------------------------------------------------------------------------------


def test_torchelastic_every_field() -> None:
    env = from_torchelastic(_torchrun())
    assert env == ClusterEnvironment(
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29500,
        restart_count=2,
        source="torchelastic",
        uses_agent_store=True,
    )
    assert env.rank == 5
    assert env.world_size == 8
    assert env.local_rank == 1
    assert env.local_world_size == 4
    assert env.node_rank == 1
    assert env.master_addr == "10.0.0.1"
    assert env.master_port == 29500
    assert env.restart_count == 2
    assert env.source == "torchelastic"
    assert env.uses_agent_store is True
    assert env.is_distributed is True


def test_torchelastic_detected() -> None:
    assert detect_environment(_torchrun()) == from_torchelastic(_torchrun())
    assert detect_environment(_torchrun()).source == "torchelastic"


def test_torchelastic_detected_without_run_id() -> None:
    # Plain RANK + WORLD_SIZE (e.g. a hand-written launcher) is enough.
    env = detect_environment(_torchrun(TORCHELASTIC_RUN_ID=None))
    assert env.source == "torchelastic"
    assert env.rank == 5


def test_torchelastic_defaults_when_optional_variables_missing() -> None:
    env = from_torchelastic(
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1234"}
    )
    assert env == ClusterEnvironment(
        rank=1,
        world_size=2,
        local_rank=0,
        local_world_size=2,
        node_rank=0,
        master_addr="localhost",
        master_port=1234,
        restart_count=0,
        source="torchelastic",
        uses_agent_store=False,
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [("True", True), ("true", True), ("TRUE", True), ("False", False), ("0", False), ("", False)],
)
def test_torchelastic_agent_store_flag(value: str, expected: bool) -> None:
    assert from_torchelastic(_torchrun(TORCHELASTIC_USE_AGENT_STORE=value)).uses_agent_store is (
        expected
    )


def test_torchelastic_agent_store_flag_absent() -> None:
    env = from_torchelastic(_torchrun(TORCHELASTIC_USE_AGENT_STORE=None))
    assert env.uses_agent_store is False


def test_torchelastic_single_worker_needs_no_master() -> None:
    env = from_torchelastic({"RANK": "0", "WORLD_SIZE": "1"})
    assert env == ClusterEnvironment(source="torchelastic")
    assert env.master_addr is None
    assert env.master_port is None
    assert env.is_distributed is False


# --------------------------------------------------------------------------------------------
# SLURM
# --------------------------------------------------------------------------------------------


def test_slurm_every_field() -> None:
    env = from_slurm(_slurm())
    assert env == ClusterEnvironment(
        rank=6,
        world_size=8,
        local_rank=2,
        local_world_size=4,
        node_rank=1,
        master_addr="gpu003",
        master_port=15000 + 123456 % 20000,
        restart_count=0,
        source="slurm",
        uses_agent_store=False,
    )
    assert env.master_port == 18456
    assert env.is_distributed is True


def test_slurm_detected() -> None:
    assert detect_environment(_slurm()) == from_slurm(_slurm())
    assert detect_environment(_slurm()).source == "slurm"


def test_slurm_plain_nodelist_and_restart_count() -> None:
    env = from_slurm(_slurm(SLURM_NODELIST="node7", SLURM_RESTART_COUNT="3"))
    assert env.master_addr == "node7"
    assert env.restart_count == 3


@pytest.mark.parametrize(
    ("job_id", "port"),
    [("0", 15000), ("1", 15001), ("19999", 34999), ("20000", 15000), ("123456", 18456)],
)
def test_slurm_port_derived_from_job_id(job_id: str, port: int) -> None:
    assert from_slurm(_slurm(SLURM_JOB_ID=job_id)).master_port == port


def test_slurm_master_addr_and_port_override() -> None:
    env = from_slurm(_slurm(MASTER_ADDR="login1", MASTER_PORT="4242"))
    assert env.master_addr == "login1"
    assert env.master_port == 4242


def test_slurm_empty_master_variables_fall_back_to_slurm() -> None:
    env = from_slurm(_slurm(MASTER_ADDR="", MASTER_PORT=""))
    assert env.master_addr == "gpu003"
    assert env.master_port == 18456


@pytest.mark.parametrize(
    ("per_node", "nnodes", "expected"),
    [("4(x2)", "2", 4), ("4", "2", 4), (None, "2", 4), (None, None, 8), ("", "4", 2)],
)
def test_slurm_local_world_size(per_node: str | None, nnodes: str | None, expected: int) -> None:
    env = from_slurm(_slurm(SLURM_NTASKS_PER_NODE=per_node, SLURM_NNODES=nnodes, SLURM_LOCALID="0"))
    assert env.local_world_size == expected


def test_slurm_optional_variables_default() -> None:
    env = from_slurm({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train"})
    assert env == ClusterEnvironment(source="slurm")


@pytest.mark.parametrize("job_name", ["bash", "interactive"])
def test_interactive_salloc_shell_is_not_slurm(job_name: str) -> None:
    env = _slurm(SLURM_JOB_NAME=job_name)
    assert detect_environment(env) == ClusterEnvironment(source="single")


def test_salloc_shell_without_procid_is_not_slurm() -> None:
    assert detect_environment(_slurm(SLURM_PROCID=None)).source == "single"


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("gpu[003-005,9],cpu1", "gpu003"),
        ("node7", "node7"),
        ("node7,node8", "node7"),
        ("node[1-4]", "node1"),
        ("node[12,3]", "node12"),
        ("a100-[07-08]", "a100-07"),
        ("  node[0002-0004]", "node0002"),
        ("login.cluster.org", "login.cluster.org"),
        ("cpu1,gpu[003-005]", "cpu1"),
    ],
)
def test_first_slurm_host(nodelist: str, host: str) -> None:
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "   ", "[1-3]", ",node1"])
def test_first_slurm_host_unreadable(nodelist: str) -> None:
    with _raises(f"cannot read a host from SLURM_NODELIST={nodelist!r}"):
        first_slurm_host(nodelist)


# SLURM host lists may carry text after a bracket or several bracketed ranges.
@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("rack[0-63]_blade[0-41]", "rack0_blade0"), ("node[1-2]-ib,cpu1", "node1-ib")],
)
def test_first_slurm_host_with_suffix(nodelist: str, host: str) -> None:
    assert first_slurm_host(nodelist) == host


# --------------------------------------------------------------------------------------------
# OpenMPI
# --------------------------------------------------------------------------------------------


def test_mpi_every_field_ignoring_node_rank() -> None:
    env = from_mpi(_mpi(OMPI_COMM_WORLD_NODE_RANK="0"))
    assert env == ClusterEnvironment(
        rank=6,
        world_size=8,
        local_rank=2,
        local_world_size=4,
        node_rank=1,
        master_addr="head-node",
        master_port=23456,
        restart_count=0,
        source="openmpi",
        uses_agent_store=False,
    )


@pytest.mark.parametrize(("rank", "node_rank"), [("0", 0), ("3", 0), ("4", 1), ("7", 1)])
def test_mpi_node_rank_fallback(rank: str, node_rank: int) -> None:
    env = from_mpi(_mpi(OMPI_COMM_WORLD_RANK=rank))
    assert env.node_rank == node_rank
    assert env.node_rank == int(rank) // 4


def test_mpi_every_field_without_node_rank() -> None:
    assert from_mpi(_mpi()) == ClusterEnvironment(
        rank=6,
        world_size=8,
        local_rank=2,
        local_world_size=4,
        node_rank=1,
        master_addr="head-node",
        master_port=23456,
        source="openmpi",
    )


# Open MPI documents OMPI_COMM_WORLD_NODE_RANK as a process's index on its node (across jobs),
# not the node's index: rank 6 of 8 with 4 per node has NODE_RANK=2 but sits on node 1.
def test_mpi_node_rank_as_set_by_real_mpirun() -> None:
    env = from_mpi(_mpi(OMPI_COMM_WORLD_NODE_RANK="2"))
    assert env.node_rank == 1


def test_mpi_detected() -> None:
    assert detect_environment(_mpi()) == from_mpi(_mpi())
    assert detect_environment(_mpi()).source == "openmpi"


def test_mpi_local_size_defaults_to_world() -> None:
    env = from_mpi(_mpi(OMPI_COMM_WORLD_LOCAL_SIZE=None, OMPI_COMM_WORLD_LOCAL_RANK=None))
    assert env.local_world_size == 8
    assert env.local_rank == 0
    assert env.node_rank == 0


# --------------------------------------------------------------------------------------------
# Single process, priority, user-given environments
# --------------------------------------------------------------------------------------------


def test_empty_env_is_single_process() -> None:
    env = detect_environment({})
    assert env == ClusterEnvironment(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        master_addr=None,
        master_port=None,
        restart_count=0,
        source="single",
        uses_agent_store=False,
    )
    assert env.is_distributed is False
    assert single_process() == env
    assert single_process({"RANK": "3"}) == env


def test_unrelated_variables_are_single_process() -> None:
    assert detect_environment({"HOME": "/root", "MASTER_PORT": "1"}).source == "single"


def test_detect_environment_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        monkeypatch.delenv(key)
    for key, value in _torchrun().items():
        monkeypatch.setenv(key, value)
    assert detect_environment() == from_torchelastic(_torchrun())


def test_torchrun_wins_over_slurm() -> None:
    # `srun torchrun ...`: each worker sees both sets; torchrun's per-worker ranks must win.
    env = detect_environment({**_slurm(), **_torchrun()})
    assert env == from_torchelastic(_torchrun())
    assert env.source == "torchelastic"


def test_torchrun_wins_over_mpi_and_slurm_wins_over_mpi() -> None:
    assert detect_environment({**_mpi(), **_torchrun()}).source == "torchelastic"
    assert detect_environment({**_mpi(), **_slurm()}).source == "slurm"


def test_user_environment_valid() -> None:
    env = ClusterEnvironment(
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        node_rank=1,
        master_addr="host",
        master_port=1,
    )
    assert env.source == "user"
    assert env.is_distributed is True


def test_user_environment_is_frozen() -> None:
    env = ClusterEnvironment()
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'rank'"):
        env.rank = 1  # type: ignore[misc]
    assert env.rank == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"rank": 2, "world_size": 2, "master_addr": "h", "master_port": 1},
            "rank=2 must be in [0, world_size=2)",
        ),
        ({"rank": -1}, "rank=-1 must be in [0, world_size=1)"),
        ({"world_size": 0}, "world_size=0 must be >= 1"),
        (
            {"world_size": 2, "master_port": 1},
            "world_size=2 needs a master address: set master_addr",
        ),
        (
            {"world_size": 2, "master_addr": ""},
            "world_size=2 needs a master address: set master_addr",
        ),
        (
            {"world_size": 2, "master_addr": "h"},
            "world_size=2 needs a master port: set master_port",
        ),
        ({"local_rank": 1}, "local_rank=1 must be in [0, local_world_size=1)"),
        ({"local_world_size": 2}, "local_world_size=2 must be in [1, world_size=1]"),
        ({"local_world_size": 0}, "local_world_size=0 must be in [1, world_size=1]"),
        ({"master_port": 65536}, "master_port=65536 is not a TCP port"),
        ({"master_port": 0}, "master_port=0 is not a TCP port"),
    ],
)
def test_user_environment_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ClusterEnvironmentError) as info:
        ClusterEnvironment(**kwargs)
    text = str(info.value)
    assert message in text
    assert text.startswith("inconsistent user environment: ")
    assert text.endswith(". Fix the launcher's variables or pass a ClusterEnvironment explicitly.")


def _caught(catch: type[Exception], env: dict[str, str]) -> tuple[str, str]:
    """What `except catch` receives from detecting `env`: the error's type name and message."""
    try:
        detect_environment(env)
    except catch as error:
        return type(error).__name__, str(error)
    return "no error", ""


def test_error_types() -> None:
    """Launcher code written against plain Python catches ValueError; manualpar-aware code
    catches ManualParError: both receive the full message naming the launcher's variables."""
    contradiction = _torchrun(RANK="2", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    message = (
        "inconsistent torchelastic environment: RANK=2 must be in [0, WORLD_SIZE=2). Fix the "
        "launcher's variables or pass a ClusterEnvironment explicitly."
    )
    assert _caught(ValueError, contradiction) == ("ClusterEnvironmentError", message)
    assert _caught(ManualParError, contradiction) == ("ClusterEnvironmentError", message)
    not_a_number = _torchrun(RANK="abc")
    assert _caught(ValueError, not_a_number) == (
        "ClusterEnvironmentError",
        "environment variable RANK='abc' is not an integer",
    )
    with pytest.raises(ValueError, match=re.escape("RANK=2 must be in [0, WORLD_SIZE=2)")):
        from_torchelastic(_torchrun(RANK="2", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"))


def test_all_problems_reported_together() -> None:
    with pytest.raises(ClusterEnvironmentError) as info:
        from_torchelastic({"RANK": "3", "WORLD_SIZE": "2"})
    text = str(info.value)
    assert "RANK=3 must be in [0, WORLD_SIZE=2)" in text
    assert "WORLD_SIZE=2 needs a master address: set MASTER_ADDR" in text
    assert "WORLD_SIZE=2 needs a master port: set MASTER_PORT" in text
    assert text.count("; ") == 2


# --------------------------------------------------------------------------------------------
# Inconsistent launcher variables: each error names the launcher's own variables.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
            "RANK=2 must be in [0, WORLD_SIZE=2)",
        ),
        ({"RANK": "-1"}, "RANK=-1 must be in [0, WORLD_SIZE=8)"),
        ({"MASTER_ADDR": None}, "WORLD_SIZE=8 needs a master address: set MASTER_ADDR"),
        ({"MASTER_ADDR": ""}, "WORLD_SIZE=8 needs a master address: set MASTER_ADDR"),
        ({"MASTER_PORT": None}, "WORLD_SIZE=8 needs a master port: set MASTER_PORT"),
        ({"MASTER_PORT": ""}, "WORLD_SIZE=8 needs a master port: set MASTER_PORT"),
        ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4 must be in [0, LOCAL_WORLD_SIZE=4)"),
        ({"LOCAL_WORLD_SIZE": "16"}, "LOCAL_WORLD_SIZE=16 must be in [1, WORLD_SIZE=8]"),
        (
            {"LOCAL_WORLD_SIZE": "0", "LOCAL_RANK": "0"},
            "LOCAL_WORLD_SIZE=0 must be in [1, WORLD_SIZE=8]",
        ),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT=0 is not a TCP port"),
        ({"MASTER_PORT": "-5"}, "MASTER_PORT=-5 is not a TCP port"),
        (
            {"WORLD_SIZE": "0", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": None},
            "WORLD_SIZE=0 must be >= 1",
        ),
    ],
)
def test_torchelastic_inconsistent(overrides: dict, message: str) -> None:
    with _raises(message) as info:
        from_torchelastic(_torchrun(**overrides))
    assert str(info.value).startswith("inconsistent torchelastic environment: ")
    # detect_environment goes through the same validation.
    with _raises(message):
        detect_environment(_torchrun(**overrides))


def test_torchelastic_rank_equal_world_names_both_variables() -> None:
    with pytest.raises(ClusterEnvironmentError) as info:
        from_torchelastic(_torchrun(RANK="2", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"))
    assert "RANK=2" in str(info.value)
    assert "WORLD_SIZE=2" in str(info.value)


def test_torchelastic_world_size_zero_reports_local_world_size_too() -> None:
    with pytest.raises(ClusterEnvironmentError) as info:
        from_torchelastic({"RANK": "0", "WORLD_SIZE": "0"})
    text = str(info.value)
    assert "WORLD_SIZE=0 must be >= 1" in text
    assert "LOCAL_WORLD_SIZE=0 must be in [1, WORLD_SIZE=0]" in text


@pytest.mark.parametrize(
    "key",
    [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
    ],
)
@pytest.mark.parametrize("value", ["abc", "1.5", "0x10"])
def test_torchelastic_non_integer(key: str, value: str) -> None:
    with _raises(f"environment variable {key}={value!r} is not an integer"):
        from_torchelastic(_torchrun(**{key: value}))


@pytest.mark.parametrize("key", ["RANK", "WORLD_SIZE"])
def test_torchelastic_missing_required(key: str) -> None:
    with _raises(f"environment variable {key} is not set"):
        from_torchelastic(_torchrun(**{key: None}))


def test_torchelastic_run_id_without_rank() -> None:
    with _raises("environment variable RANK is not set"):
        detect_environment({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8 must be in [0, SLURM_NTASKS=8)"),
        (
            {"SLURM_PROCID": "2", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1"},
            "SLURM_PROCID=2 must be in [0, SLURM_NTASKS=2)",
        ),
        (
            {"SLURM_NODELIST": None},
            "SLURM_NTASKS=8 needs a master address: set SLURM_NODELIST/MASTER_ADDR",
        ),
        ({"SLURM_JOB_ID": None}, "SLURM_NTASKS=8 needs a master port: set MASTER_PORT"),
        ({"SLURM_LOCALID": "4"}, "SLURM_LOCALID=4 must be in [0, SLURM_NTASKS_PER_NODE=4)"),
        (
            {"SLURM_NTASKS_PER_NODE": "16(x2)"},
            "SLURM_NTASKS_PER_NODE=16 must be in [1, SLURM_NTASKS=8]",
        ),
        ({"MASTER_PORT": "65536"}, "MASTER_PORT=65536 is not a TCP port"),
        (
            {
                "SLURM_NTASKS": "0",
                "SLURM_PROCID": "0",
                "SLURM_NTASKS_PER_NODE": None,
                "SLURM_LOCALID": "0",
            },
            "SLURM_NTASKS=0 must be >= 1",
        ),
    ],
)
def test_slurm_inconsistent(overrides: dict, message: str) -> None:
    with _raises(message) as info:
        from_slurm(_slurm(**overrides))
    assert str(info.value).startswith("inconsistent slurm environment: ")
    with _raises(message):
        detect_environment(_slurm(**overrides))


def test_slurm_rank_out_of_range_names_slurm_procid() -> None:
    with pytest.raises(ClusterEnvironmentError, match="SLURM_PROCID") as info:
        from_slurm(_slurm(SLURM_PROCID="9"))
    assert "SLURM_PROCID=9 must be in [0, SLURM_NTASKS=8)" in str(info.value)


@pytest.mark.parametrize(
    "key",
    [
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_NNODES",
        "SLURM_RESTART_COUNT",
        "MASTER_PORT",
    ],
)
def test_slurm_non_integer(key: str) -> None:
    with _raises(f"environment variable {key}='four' is not an integer"):
        from_slurm(_slurm(**{key: "four"}))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"OMPI_COMM_WORLD_RANK": "8"},
            "OMPI_COMM_WORLD_RANK=8 must be in [0, OMPI_COMM_WORLD_SIZE=8)",
        ),
        ({"MASTER_ADDR": None}, "OMPI_COMM_WORLD_SIZE=8 needs a master address: set MASTER_ADDR"),
        ({"MASTER_PORT": None}, "OMPI_COMM_WORLD_SIZE=8 needs a master port: set MASTER_PORT"),
        (
            {"OMPI_COMM_WORLD_LOCAL_RANK": "4"},
            "OMPI_COMM_WORLD_LOCAL_RANK=4 must be in [0, OMPI_COMM_WORLD_LOCAL_SIZE=4)",
        ),
        (
            {"OMPI_COMM_WORLD_LOCAL_SIZE": "9"},
            "OMPI_COMM_WORLD_LOCAL_SIZE=9 must be in [1, OMPI_COMM_WORLD_SIZE=8]",
        ),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT=99999 is not a TCP port"),
        (
            {
                "OMPI_COMM_WORLD_SIZE": "0",
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_SIZE": None,
            },
            "OMPI_COMM_WORLD_SIZE=0 must be >= 1",
        ),
    ],
)
def test_mpi_inconsistent(overrides: dict, message: str) -> None:
    with _raises(message) as info:
        from_mpi(_mpi(**overrides))
    assert str(info.value).startswith("inconsistent openmpi environment: ")
    with _raises(message):
        detect_environment(_mpi(**overrides))


def test_mpi_rank_out_of_range_names_ompi_variable() -> None:
    with pytest.raises(ClusterEnvironmentError, match="OMPI_COMM_WORLD_RANK"):
        from_mpi(_mpi(OMPI_COMM_WORLD_RANK="10"))


@pytest.mark.parametrize(
    "key",
    [
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MASTER_PORT",
    ],
)
def test_mpi_non_integer(key: str) -> None:
    with _raises(f"environment variable {key}='x1' is not an integer"):
        from_mpi(_mpi(**{key: "x1"}))
