"""`ManualParallelStrategy(num_processes=N)`: the torchrun command a plain script is re-run
under, and the refusals (no script file, bad counts, a launcher that started another number).
The relaunch itself, killed and resumed, is tests/e2e/test_trainer_restart.py."""

from __future__ import annotations

import sys

import pytest

import manualpar as mp
from manualpar.errors import ClusterEnvironmentError
from manualpar.strategy.self_launch import check_num_processes, launch_command, launched


def test_the_script_is_re_run_under_torchrun_with_its_arguments() -> None:
    command = launch_command(2, 1, ["train.py", "--out", "runs"], None)
    assert command == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "train.py", "--", "--out", "runs",
    ]  # fmt: skip
    as_module = launch_command(4, 0, ["/x/train.py", "--out", "runs"], "pkg.train")
    assert as_module[-5:] == ["-m", "pkg.train", "--", "--out", "runs"]


def test_script_flags_that_abbreviate_torchrun_options_reach_the_script(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torchrun's parser refused `--nproc` after the script (an abbreviation of its
    --nproc-per-node); the command ends torchrun's options first. Parsed by torchrun's own
    parser, without starting anything."""
    from torch.distributed.run import get_args_parser

    command = launch_command(2, 0, ["train.py", "--nproc", "2", "--", "x"], None)
    args = get_args_parser().parse_args(command[3:])
    assert (args.training_script, args.training_script_args) == (
        "train.py",
        ["--nproc", "2", "--", "x"],  # the script's own arguments, as it was given them
    )


@pytest.mark.parametrize("argv", [[""], ["-c"], []])
def test_no_script_file_is_refused(argv: list[str]) -> None:
    with pytest.raises(ClusterEnvironmentError, match="this process runs no script file"):
        launch_command(2, 0, argv, None)


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ClusterEnvironmentError, match=r"num_processes=0\): pass a whole number"):
        check_num_processes(0, 0)
    with pytest.raises(ClusterEnvironmentError, match=r"max_restarts=-1\): pass a whole number"):
        check_num_processes(2, -1)


def test_only_a_process_no_launcher_started_relaunches() -> None:
    assert not launched({"HOME": "/"})
    assert launched({"RANK": "0"}) and launched({"SLURM_PROCID": "3"})


def test_a_launcher_with_another_process_count_is_refused() -> None:
    environment = mp.ClusterEnvironment(rank=0, world_size=1, local_rank=0, local_world_size=1)
    assert mp.ManualParallelStrategy(environment, num_processes=1).world_size == 1
    with pytest.raises(
        ClusterEnvironmentError, match=r"num_processes=2\) but the launcher started 1"
    ):
        mp.ManualParallelStrategy(environment, num_processes=2)
