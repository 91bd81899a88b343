"""Optional C++ kernels for the CPU backward and init, compiled at first use and cached.

torch's extension loader builds the files of `csrc/` once per machine and source version (about
40 s, under torch's extensions cache; `TORCH_EXTENSIONS_DIR` moves it). Each version has its own
directory, named by a hash of the source, the torch version and the flags, so a built library is
imported directly (milliseconds, no compiler or ninja run) and two versions never overwrite each
other. Ranks of one job that start together share the build: torch's loader takes a lock in the
build directory (a killed build's lock is removed once STALE_LOCK_S old). Where no compiler is
found, or `MANUALPAR_NATIVE_KERNELS=0`, everything runs on the pure-torch path (the one CUDA
tensors always take), with the same numbers, more slowly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from manualpar.errors import MissingDependencyError

__all__ = ["clear_stale_lock", "native_kernels", "native_kernels_take", "wait_for_build"]

# sparse_rows.cpp holds the module definition; the other files' functions are bound there
SOURCES = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "sparse_rows.cpp",
        "row_groups.cpp",
        "pooled_rows.cpp",
        "half_rows.cpp",
        "table_init.cpp",
        "split_rows.cpp",
        "raw_ids.cpp",
        "row_io.cpp",
        "row_cache.cpp",
        "table_batch.cpp",
    )
)
# included by the sources: part of the version too
HEADERS = tuple(
    Path(__file__).parent / "csrc" / name
    for name in (
        "avx2_rows.h",
        "avx512_rows.h",
        "half_rows.h",
        "kept_threads.h",
        "kernel_checks.h",
        "pool_float.h",
        "prefetch.h",
        "row_gradients.h",
        "row_groups.h",
        "rowwise_block.h",
        "rowwise_row.h",
        "splitmix.h",
        "table_batch_update.h",
    )
)
ENV_SWITCH = "MANUALPAR_NATIVE_KERNELS"
# no FMA contraction: the kernels must round as the torch ops do, on every machine
CFLAGS = ["-O3", "-ffp-contract=off"]
# half rows (float16, bfloat16) have kernels of their own, which sum and update in float32
_NATIVE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# A build takes about 40 s; a lock older than this was left by a build that was killed, and
# torch's loader would wait on it forever.
STALE_LOCK_S = 600
_loaded: ModuleType | None = None
_tried = False


def _build_name() -> str:
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {CFLAGS}".encode())
    return f"manualpar_sparse_rows_{digest.hexdigest()[:16]}"


def _extensions_root() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "torch_extensions" / f"py{sys.version_info[0]}{sys.version_info[1]}_cpu"


def _import_built(name: str, directory: Path) -> ModuleType | None:
    library = directory / f"{name}.so"
    if not library.exists() or (directory / "lock").exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clear_stale_lock(directory: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove a build lock older than `max_age_s` (its build was killed); True if removed."""
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime <= max_age_s:
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    warnings.warn(
        f"manualpar: removed a stale build lock {lock} (a build was interrupted); "
        "building the C++ kernels again",
        RuntimeWarning,
        stacklevel=3,
    )
    return True


def wait_for_build(directory: Path, max_age_s: float = STALE_LOCK_S, poll_s: float = 0.5) -> None:
    """Wait while another process builds in `directory`, at most until its lock is `max_age_s`
    old (then it was killed, and the lock goes): torch's loader would wait on a dead build's
    lock forever."""
    while (directory / "lock").exists():
        if clear_stale_lock(directory, max_age_s):
            return
        time.sleep(poll_s)


def native_kernels() -> ModuleType | None:
    """The compiled kernels, or None (switched off, or no compiler: warns once why)."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    name = _build_name()
    directory = _extensions_root() / name
    try:
        _loaded = _import_built(name, directory)
        if _loaded is None:
            from torch.utils.cpp_extension import load

            directory.mkdir(parents=True, exist_ok=True)
            wait_for_build(directory)
            _loaded = _import_built(name, directory) or load(
                name,
                [str(source) for source in SOURCES],
                extra_cflags=CFLAGS,
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as error:  # no compiler, no ninja, a failed build: fall back, loudly
        warnings.warn(
            f"manualpar: the C++ embedding kernels could not be built ({error}); "
            f"using the pure-torch path, which gives the same results more slowly. "
            f"Set {ENV_SWITCH}=0 to skip the build.",
            RuntimeWarning,
            stacklevel=2,
        )
    return _loaded


def loaded_kernels() -> ModuleType:
    """The compiled kernels, for a caller that checked `native_kernels_take(...)` first."""
    kernels = native_kernels()
    if kernels is None:
        raise MissingDependencyError(
            "the C++ embedding kernels are not available (not built here, or switched off by "
            f"{ENV_SWITCH}=0); a caller checks native_kernels_take() first"
        )
    return kernels


def native_kernels_take(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels handle these tensors (CPU; float32/float64, or float16/bfloat16
    rows for the half-row kernels: callers check the dtypes a kernel takes)."""
    for tensor in tensors:
        if tensor is None:
            continue
        if tensor.device.type != "cpu":
            return False
        if tensor.is_floating_point() and tensor.dtype not in _NATIVE_DTYPES:
            return False
    return native_kernels() is not None
