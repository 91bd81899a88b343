"""Two nodes on one machine: two torchrun agents of 2 processes each, meeting through a c10d
rendezvous on 127.0.0.1 as the agents of a real 2-node job do (tests/support/launch.py,
`start_nodes`). The ranks run the cases of tests/support/node_cases.py."""

from __future__ import annotations

import argparse
import json
import socket
import time
from pathlib import Path

import pytest
import torch
from launch import run_nodes, run_python, start_nodes
from node_cases import reference_losses, reports
from node_compositions import load_mixed, mixed_reference
from torchx.components.dist import ddp as torchx_ddp
from torchx.runner import get_runner

import manualpar as mp
from manualpar.cli.torchx_component import run_script
from manualpar.testing import free_port, run_distributed

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "two_nodes.py"
LOST_NODE_EXIT_S = 30  # every survivor of a lost node exits within this, naming the lost ranks


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """One 2 nodes x 2 processes job running every case of the tests below (each job costs
    two agents and four processes their startup): its reports folder, and its agents' pids. The
    mixed model's checkpoint goes to the folder's `shared/`."""
    out = tmp_path_factory.mktemp("two_by_two")
    cases = "ranks,ddp,hsdp,fsdp_tp,mixed"
    args = ("--cases", cases, "--out", str(out / "2x2"), "--dir", str(out / "shared"))
    with start_nodes(SCRIPT, *args) as job:
        job.wait(150, check=True)
        agents = [process.pid for process in job.processes]
    return out, agents


def test_ranks_mesh_and_ddp_across_two_nodes(two_by_two: tuple[Path, list[int]]) -> None:
    folder, agents = two_by_two
    tmp_path = folder / "2x2"
    seen = reports(tmp_path, "ranks")
    assert [r["rank"] for r in seen] == [0, 1, 2, 3]
    assert [(r["node_rank"], r["local_rank"]) for r in seen] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["agent_pid"] for r in seen] == [agents[0], agents[0], agents[1], agents[1]]
    for r in seen:
        assert (r["world_size"], r["num_nodes"], r["local_world_size"]) == (4, 2, 2)
        assert r["source"] == "torchelastic"
        # strategy.mesh(node=2, local=2): a row per node, a column per local rank
        assert r["mesh"] == [[0, 1], [2, 3]] and r["mesh_dims"] == ["node", "local"]
        node, local = r["node_rank"], r["local_rank"]
        assert r["local_members"] == [2 * node, 2 * node + 1]  # the ranks of this node
        assert r["node_members"] == [local, 2 + local]  # this local rank on every node
        assert r["local_sum"] == sum(r["local_members"])
        assert r["node_sum"] == sum(r["node_members"])
    # DDP over 4 ranks on 2 nodes, each on a quarter of the batch == one process on all of it
    expected = reference_losses()
    for r in reports(tmp_path, "ddp"):
        assert r["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def _close(actual: object, expected: object, what: str) -> None:
    """Nested reports (dicts and lists of numbers) equal within float32 training noise."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), what
        for key in expected:
            _close(actual[key], expected[key], f"{what}[{key!r}]")
    elif (
        isinstance(expected, list)
        and any(isinstance(e, (list, dict)) for e in expected)
        and (
            len({len(e) if isinstance(e, list) else -1 for e in expected}) > 1
            or any(isinstance(e, dict) for e in expected)
        )
    ):  # parameters of different shapes, or per-parameter state: one by one
        assert isinstance(actual, list) and len(actual) == len(expected), what
        for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
            _close(got, want, f"{what}[{index}]")
    else:
        got, want = torch.tensor(actual), torch.tensor(expected)
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), f"{what}: {got} != {want}"


def test_compositions_across_two_nodes_and_their_checkpoint_in_other_shapes(
    two_by_two: tuple[Path, list[int]], tmp_path: Path
) -> None:
    """HSDP, FSDP x TP and a mixed model (2-D tables + HSDP top) on 2 nodes x 2, each against
    one process; the mixed model's checkpoint then loads into 1, 2 and 3 processes and into a
    4 x 1 job, tables, table optimizer state, dense weights and Adam state included."""
    shared = two_by_two[0] / "shared"
    out = two_by_two[0] / "2x2"
    expected_losses = reference_losses()
    for name in ("hsdp", "fsdp_tp"):
        for r in reports(out, name):
            _close(r["losses"], expected_losses, name)
    reference = mixed_reference()
    saved = reports(out, "mixed")
    for r in saved:
        _close(r["losses"], reference["losses"], "mixed model losses")
        for key in ("tables", "table_state", "top", "top_state"):
            _close(r[key], reference[key], f"mixed model {key}")
    # the script as a plain process and as a job of 4 one-process nodes; 2 and 3 ranks from
    # the fork server (the same case, without two more torchrun agents and their workers)
    loaders = {
        "1 process": lambda o: run_python(SCRIPT, *o, timeout=120, check=True),
        "4 x 1": lambda o: run_nodes(SCRIPT, *o, nnodes=4, nproc=1, timeout=150, check=True),
    }
    loaded_by = {}
    for shape, launch in loaders.items():
        where = tmp_path / shape.replace(" ", "_")
        launch(("--cases", "load_mixed", "--out", str(where), "--dir", str(shared)))
        loaded_by[shape] = reports(where, "load_mixed")
    for world in (2, 3):
        loaded_by[f"{world} processes"] = run_distributed(
            _load_mixed, world, args=(str(shared),), timeout=90
        )
    for shape, loaded in loaded_by.items():
        assert loaded, shape
        for r in loaded:
            for key in ("tables", "table_state", "top", "top_state"):
                assert r[key] == saved[0][key], f"{key} loaded by {shape}"


def _load_mixed(shared: str) -> dict:
    """One rank of the `load_mixed` case, run by run_distributed; its report as JSON gives it."""
    strategy = mp.ManualParallelStrategy()
    report = json.loads(json.dumps(load_mixed(strategy, argparse.Namespace(dir=shared))))
    strategy.teardown()
    return report


def test_survivors_of_a_lost_node_name_its_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "lose_node"
    # Also: another process takes the first port start_nodes picks before node 0 binds it (here
    # a socket listening there); the job starts again on another port.
    taken = socket.create_server(("127.0.0.1", 0))
    ports = [taken.getsockname()[1]]
    monkeypatch.setattr("launch.free_port", lambda: ports.pop() if ports else free_port())

    def training_everywhere() -> bool:
        return all((folder / f"training_{rank}").exists() for rank in range(4))

    env = {"MANUALPAR_TIMEOUT_S": "20"}  # a collective timeout well inside the bound below
    with start_nodes(SCRIPT, "--cases", "lose_node", "--out", str(tmp_path), env=env) as job:
        job.wait_for(training_everywhere, 120, "training on both nodes")
        killed = time.time()
        job.kill_node(1)  # node 0 hosts the stores; node 1 is lost as a machine is
        (node0,) = job.wait(LOST_NODE_EXIT_S, nodes=[0])  # fails the test if a survivor hangs
    print(f"\nMEASURED node 0 exited {time.time() - killed:.1f}s after node 1 was killed")
    assert node0.returncode != 0
    for rank in (0, 1):
        failure = json.loads((folder / f"error_{rank}.json").read_text())
        assert failure["error"].startswith(
            f"gradient all_reduce (op=mean, shape=(57,)) failed on rank {rank} of 4"
        )
        assert (
            "No answer: ranks 2, 3 (node 1) did not answer a roll call within 3s"
            in failure["error"]
        )
        print(f"MEASURED rank {rank} raised {failure['time'] - killed:.1f}s after the kill")
    assert not list(folder.glob("error_[23].json"))  # the lost ranks said nothing
    assert "No answer: ranks 2, 3 (node 1)" in node0.stderr  # what the user sees in node 0's log
    assert ports == []  # the taken port was tried first
    taken.close()


def test_torchx_two_by_two_runs_torchrun_on_two_nodes_with_c10d() -> None:
    manualpar = run_script("--steps", "3", script="train.py", j="2x2")
    builtin = torchx_ddp("--steps", "3", script="train.py", j="2x2")
    with get_runner() as runner:
        commands = {
            name: [
                " ".join(params.args)
                for params in runner.dryrun(app, "local_cwd", cfg={}).request.role_params[
                    app.roles[0].name
                ]
            ]
            for name, app in (("manualpar", manualpar), ("dist.ddp", builtin))
        }
    for name, nodes in commands.items():
        assert len(nodes) == 2, name  # one torchrun agent per node
        for command in nodes:
            flags = command.replace("_", "-")  # dist.ddp spells --nproc_per_node
            assert "--nnodes 2" in flags and "--nproc-per-node 2" in flags, command
            assert "--rdzv-backend c10d" in flags, command
            assert "--rdzv-endpoint ${TORCHX-RANK0-HOST:=localhost}:29500" in flags, command
            assert command.endswith("train.py --steps 3"), command
