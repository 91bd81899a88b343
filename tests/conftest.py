from __future__ import annotations

import pytest

LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_SIZE",
)


@pytest.fixture(autouse=True)
def _single_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests run as a single process, whatever launcher started pytest."""
    for key in LAUNCHER_VARIABLES:
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(autouse=True, scope="session")
def _native_kernels_built() -> None:
    """Build the C++ embedding kernels once, before any test starts ranks: a first build takes
    tens of seconds, longer than the tests' collective timeouts."""
    from manualpar.embeddings.native import native_kernels

    native_kernels()
