"""torch.compile on a model with sharded tables gives the eager run's numbers.

The model (tests/support/compile_cases.py) has sharded tables of every placement and two MLPs
under ddp(); the compiled run and the eager one start from the same seeds and see the same
batches, whose size changes at one step (a recompile with dynamic shapes). The sharded lookup is a
graph break by design: the tests also check that the MLPs were in the compiled graphs.
"""

from __future__ import annotations

import pytest
from compile_cases import assert_same_run, compiled_and_eager, cpp_compiler

from manualpar.testing import run_distributed


@pytest.mark.timeout(180)
def test_compiled_model_matches_eager_on_2_ranks():
    sizes = [[5, 5, 7, 5], [3, 3, 6, 3]]  # per rank and step
    per_rank = run_distributed(compiled_and_eager, 2, args=("aot_eager", sizes), timeout=170)
    for rank, out in enumerate(per_rank):
        # bottom (1 Linear) and top (2) compiled under DDP, and the interaction's cat
        assert out["ops"].count("linear") >= 3 and "cat" in out["ops"], out["ops"]
        assert_same_run(out["compiled"], out["eager"], f"rank {rank}", rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(
    cpp_compiler() is None,
    reason="inductor builds its CPU kernels with a C++ compiler ($CXX or g++), none on PATH",
)
@pytest.mark.timeout(300)
def test_inductor_compiled_in_place_matches_eager_on_one_process():
    """model.compile() (in place: the state_dict keys the Trainer and checkpoints use stay)."""
    args = ("inductor", [[6, 6, 9, 6]], True)
    (out,) = run_distributed(compiled_and_eager, 1, args=args, timeout=290)
    assert out["ops"].count("linear") >= 3, out["ops"]
    # inductor fuses and reorders float ops: equal up to rounding, not bit for bit
    assert_same_run(out["compiled"], out["eager"], "one process", rtol=1e-5, atol=1e-6)
