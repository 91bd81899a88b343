"""Optional C++ kernels for the CPU backward, compiled at first use and cached.

torch's extension loader builds `csrc/sparse_rows.cpp` once per machine (about 40 s, in torch's
extensions cache; `TORCH_EXTENSIONS_DIR` moves it) and reloads it afterwards in milliseconds.
Ranks of one job that start together share the build: torch's loader takes a lock in the build
directory. Where no compiler is found, or `MANUALPAR_NATIVE_KERNELS=0`, everything runs on the
pure-torch path (the one CUDA tensors always take), with the same numbers, more slowly.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["native_kernels", "supports"]

SOURCE = Path(__file__).parent / "csrc" / "sparse_rows.cpp"
ENV_SWITCH = "MANUALPAR_NATIVE_KERNELS"
_NATIVE_DTYPES = (torch.float32, torch.float64)
_loaded: ModuleType | None = None
_tried = False


def native_kernels() -> ModuleType | None:
    """The compiled kernels, or None (switched off, or no compiler: warns once why)."""
    global _loaded, _tried
    if _tried:
        return _loaded
    _tried = True
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        # no FMA contraction: the kernels must round as the torch ops do on every machine
        _loaded = load("manualpar_sparse_rows", [str(SOURCE)],
                       extra_cflags=["-O3", "-ffp-contract=off"], verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: fall back, loudly
        warnings.warn(f"manualpar: the C++ embedding kernels could not be built ({error}); "
                      f"using the pure-torch path, which gives the same results more slowly. "
                      f"Set {ENV_SWITCH}=0 to skip the build.", RuntimeWarning, stacklevel=2)
    return _loaded


def supports(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels handle these tensors (CPU, float32/float64 for floating ones)."""
    for tensor in tensors:
        if tensor is None:
            continue
        if tensor.device.type != "cpu":
            return False
        if tensor.is_floating_point() and tensor.dtype not in _NATIVE_DTYPES:
            return False
    return native_kernels() is not None
