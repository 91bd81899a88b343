"""What a collective checks before it runs: every rank's tensor shape and dtype, and a mesh
given as its group.

A mismatched shape or dtype in a gloo or NCCL collective either hangs or returns garbage, so
`Collectives` all-gathers a small description of each rank's tensor first (`describe`) and
raises naming every rank's shape and dtype (`mismatch`). The description is a fixed-size int64
tensor: the same size on every rank whatever the tensors, so that gather itself cannot
mismatch. Pure functions; the gather stays in collectives.py (only the strategy calls
torch.distributed's collectives).
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed.device_mesh import DeviceMesh

from manualpar.errors import ConfigError, MeshError

__all__ = ["MAX_DIMS", "describe", "mesh_dim", "mismatch"]

MAX_DIMS = 14  # a description holds the dim count, the dtype and up to this many sizes
_KNOWN_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def _dtype_code(dtype: torch.dtype) -> int:
    """The same number on every rank for the same dtype (no per-process registry)."""
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def describe(operation: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s dim count, dtype and shape as (MAX_DIMS + 2,) int64 on its device."""
    if tensor.dim() > MAX_DIMS:
        raise ConfigError(f"{operation}: tensors with more than {MAX_DIMS} dims are not supported")
    meta = torch.full((MAX_DIMS + 2,), -1, dtype=torch.int64, device=tensor.device)
    meta[0], meta[1] = tensor.dim(), _dtype_code(tensor.dtype)
    meta[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return meta


def mismatch(described: list[torch.Tensor], dtype: torch.dtype) -> str | None:
    """Every rank's shape and dtype ("rank 0: (3,) torch.float32, ...") if they differ, else
    None; `dtype`: this rank's (named even when it is not a known one)."""
    shapes = [tuple(d[2 : 2 + int(d[0])].tolist()) for d in described]
    codes = [int(d[1]) for d in described]
    if len(set(shapes)) <= 1 and len(set(codes)) <= 1:
        return None
    by_code = {_dtype_code(known): known for known in (*_KNOWN_DTYPES, dtype)}
    return ", ".join(
        f"rank {r}: {shape} {by_code.get(code, '?')}"
        for r, (shape, code) in enumerate(zip(shapes, codes, strict=True))
    )


def mesh_dim(mesh: DeviceMesh) -> DeviceMesh:
    """A mesh passed as a collective's group must be one dim of a mesh (mesh["shard"])."""
    if mesh.ndim != 1:
        names = mesh.mesh_dim_names or ()
        raise MeshError(
            f"a collective over a {mesh.ndim}-D mesh {dict(zip(names, mesh.shape, strict=False))} "
            f"is ambiguous; pass one dim, e.g. group=mesh[{names[0]!r}]"
            if names
            else f"a collective over a {mesh.ndim}-D mesh is ambiguous; pass a 1-D mesh"
        )
    return mesh
