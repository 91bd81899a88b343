"""torchx component `manualpar.run_script`: any script under torchrun, local or on a cluster.

    torchx run -s local_cwd manualpar.run_script --script examples/strategy_demo.py -j 1x2
    torchx run -s slurm manualpar.run_script --script train.py -j 4x8 --max_restarts 2

The AppDef runs `python -m torch.distributed.run` directly with an absolute interpreter path, so
it works whether or not a virtualenv is on PATH (torchx's own dist.ddp goes through
`bash -c "torchrun ..."` and fails with no message when torchrun is not on PATH). Restarts come
from torchrun's --max-restarts: torchx's local scheduler ignores max_retries. Wrap your script's
main with torch.distributed.elastic.multiprocessing.errors.record so a worker's exception reaches
torchx's status.
"""

# torchx reads this signature with its own linter and argparse: keep typing.Optional/Dict and
# real (not postponed) annotations here.
import os
import shlex
import sys
from typing import Dict, Optional

from torchx import specs

from manualpar import ConfigError

__all__ = ["run_script", "trainer"]


def _nodes_and_procs(j: str) -> tuple[int, int]:
    try:
        nodes, procs = (int(part) for part in j.split("x"))
    except ValueError:
        raise ConfigError(f"-j must look like NODESxPROCS (e.g. 1x2), got {j!r}") from None
    if nodes < 1 or procs < 1:
        raise ConfigError(f"-j needs at least 1 node and 1 process per node, got {j!r}")
    return nodes, procs


def run_script(
    *script_args: str,
    script: Optional[str] = None,
    m: Optional[str] = None,
    j: str = "1x2",
    max_restarts: int = 0,
    name: str = "manualpar",
    rdzv_port: int = 29500,
    python: str = "",
    image: str = "",
    env: Optional[Dict[str, str]] = None,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    max_retries: int = 0,
) -> specs.AppDef:
    """Runs a manualpar script under torchrun (one agent per node, NPROCS workers each).

    Args:
        script_args: arguments passed to the script
        script: the script to run
        m: a module to run instead of a script (python -m)
        j: NODESxPROCS, e.g. 1x2 (one node, two processes)
        max_restarts: torchrun restarts of the whole worker group after a failure
        name: the job name
        rdzv_port: port on the first node's host for the rendezvous (multi-node only)
        python: interpreter on the nodes (default: the one running torchx)
        image: working directory or container image (default: the current directory)
        env: extra environment variables for the workers
        cpu: CPUs per node
        gpu: GPUs per node
        memMB: memory per node in MB
        max_retries: scheduler-level retries of the whole job (ignored by local_cwd)
    """
    if (script is None) == (m is None):
        raise ConfigError("pass exactly one of --script and -m")
    nodes, procs = _nodes_and_procs(j)
    python = python or sys.executable
    target = [script] if script is not None else ["-m", m]
    torchrun = [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(procs),
        "--max-restarts",
        str(max_restarts),
    ]
    if nodes == 1:
        # A free port per job: two local jobs never collide on the rendezvous.
        entrypoint, args = python, [*torchrun, "--standalone", *target, *script_args]
    else:
        # The scheduler names the first node's host in ${rank0_env}; bash expands it on each node.
        endpoint = f"$${{{specs.macros.rank0_env}:=localhost}}:{rdzv_port}"
        command = [
            shlex.quote(python),
            *torchrun,
            "--nnodes",
            str(nodes),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            specs.macros.app_id,
            *(shlex.quote(a) for a in (*target, *script_args)),
        ]
        entrypoint, args = "bash", ["-c", "exec " + " ".join(command)]
    role_env = {
        "LOGLEVEL": os.environ.get("LOGLEVEL", "WARNING"),
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name="worker",
                image=image or os.getcwd(),
                entrypoint=entrypoint,
                args=args,
                num_replicas=nodes,
                env=role_env,
                max_retries=max_retries,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB),
                port_map={"c10d": rdzv_port},
            )
        ],
    )


# The component's name before 0.2 (it launches any script, not only the Trainer); kept so existing
# command lines and .torchxconfig files keep working.
trainer = run_script
