"""DTensor checks that do not import DTensor.

`torch.distributed.tensor` costs about 0.5 s of CPU to import (and several seconds of wall on a
loaded machine), paid by every process. A tensor can only be a DTensor once that module has
been imported (something had to build it), so until then every check answers "no" for free;
the module is imported only by the builders that make DTensors (fsdp, tp).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "local_part"]

_MODULE = "torch.distributed.tensor"


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """`isinstance(value, DTensor)`, without importing DTensor when none can exist."""
    if _MODULE not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor; any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
