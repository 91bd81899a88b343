"""The embedding benchmark's Zipf ids are the same bytes in the TorchRec peer's interpreter
(its own venv) as in ours: both peers train on the same batches."""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from example_modules import EXAMPLES, load_example

workload = load_example(Path("benchmarks/embedding_workload.py"), "bench_embedding_workload_peer")
PEER_PYTHON = Path(__file__).resolve().parents[2] / ".venv-torchrec" / "bin" / "python"
ZIPF = ("--ids", "zipf", "--zipf-exponent", "1.05", "--rows", "1000", "--tables", "2")


def _workload(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    workload.add_workload_args(parser)
    return parser.parse_args(["--result", "unused.json", *flags])


DIGEST = """
import argparse, hashlib, sys
sys.path.insert(0, {folder!r})
import embedding_workload as w
parser = argparse.ArgumentParser()
w.add_workload_args(parser)
args = parser.parse_args({argv!r})
ids, lengths = w.batch_features(args, 1, 2, 3)
print(hashlib.sha1(ids.numpy().tobytes() + lengths.numpy().tobytes()).hexdigest())
"""


def _digest(args: argparse.Namespace) -> str:
    ids, lengths = workload.batch_features(args, 1, 2, 3)
    return hashlib.sha1(ids.numpy().tobytes() + lengths.numpy().tobytes()).hexdigest()


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason="no .venv-torchrec (`make torchrec-peer`)")
def test_the_torchrec_peers_python_draws_the_same_zipf_ids() -> None:
    argv = ["--result", "unused.json", *ZIPF, "--lengths", "uniform", "--batch", "64"]
    script = DIGEST.format(folder=str(EXAMPLES / "benchmarks"), argv=argv)
    digests = [
        subprocess.run(
            [python, "-c", script], capture_output=True, text=True, check=True, timeout=120
        ).stdout.strip()
        for python in (sys.executable, str(PEER_PYTHON))
    ]
    assert digests[0] == digests[1] == _digest(_workload(*argv[2:]))
