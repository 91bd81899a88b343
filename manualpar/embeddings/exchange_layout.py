"""What a sharded step's exchanges carry, in the one form both the step and the planner use.

The step sends these (step/size_header.py, step/wire.py, step/frozen.py); the planner prices a
plan's bytes from them (planning/exchange_bytes.py, planning/cost_model.py) without importing
the step:
- the size header opening every step: 3 int64 values (batch size, payload length, weighted)
  and the frozen tables' flags, WORD_BITS to an int64 word; on a 1-D mesh it rides in the ids
  all_to_all while every rank's ids payload to each other rank is at most FOLD_MAX values;
- the wire dtypes of the pooled rows (`forward`) and of their gradients (`backward`), the ones
  each exchange can carry, their short names, and the overflow flag a range-limited forward
  dtype adds for each pair of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from manualpar.errors import PlanError

__all__ = [
    "BACKWARD_DTYPES",
    "FLOAT32_WIRE",
    "FOLD_MAX",
    "FORWARD_DTYPES",
    "WIRE_NAMES",
    "WORD_BITS",
    "WireDtypes",
    "flag_bytes",
    "header_width",
    "limited",
    "num_words",
    "wire_from_dict",
    "wire_name",
    "wire_to_dict",
]

WORD_BITS = 62  # bits per int64 word of the frozen flags, clear of the sign (REFUSED is -1)
# the longest ids payload (int64 values, 256 KiB) to another rank with which a rank asks for its
# size header to ride in the ids all_to_all (step/ids_exchange.py, which says why); here so
# that the planner prices the calls a step makes (planning/rank_costs.py) without the step
# (on 2 ranks of a 2-core host, 213 KB a rank folded took 0.94x the step's process time;
# 688 KB folded 0.95-0.99x, its wall not told apart from the noise)
FOLD_MAX = 32_768


def num_words(num_tables: int) -> int:
    """int64 words holding one frozen flag per table."""
    return max(1, -(-num_tables // WORD_BITS))


def header_width(num_tables: int) -> int:
    """int64 values the size exchange sends each rank: batch size, payload length, weighted,
    and the frozen tables' flag words."""
    return 3 + num_words(num_tables)


@dataclass(frozen=True)
class WireDtypes:
    """The dtypes a collection's pooled outputs (`forward`) and output gradients (`backward`)
    travel in; the math stays float32 either way."""

    forward: torch.dtype = torch.float32
    backward: torch.dtype = torch.float32


FLOAT32_WIRE = WireDtypes()  # the default: both exchanges in float32

# What each exchange can carry (step/wire.py says why gradients need float32's range)
FORWARD_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
BACKWARD_DTYPES = (torch.float32, torch.bfloat16)

# Short names for command lines (`--wire-dtype`): the gradients travel in bfloat16 under every
# half name (float16 and 8-bit gradients are refused, see above).
WIRE_NAMES = {
    "fp32": FLOAT32_WIRE,
    "bf16": WireDtypes(torch.bfloat16, torch.bfloat16),
    "fp16": WireDtypes(torch.float16, torch.bfloat16),
    "fp8": WireDtypes(torch.float8_e4m3fn, torch.bfloat16),
}


def wire_name(wire: WireDtypes) -> str:
    """`wire` as text: its short name (WIRE_NAMES), else both dtypes."""
    for name, known in WIRE_NAMES.items():
        if known == wire:
            return name
    forward, backward = (str(d).removeprefix("torch.") for d in (wire.forward, wire.backward))
    return f"{forward}/{backward}"


def wire_to_dict(wire: WireDtypes) -> dict[str, str]:
    """`wire` for JSON: {"forward": "bfloat16", "backward": "bfloat16"}."""
    return {
        "forward": str(wire.forward).removeprefix("torch."),
        "backward": str(wire.backward).removeprefix("torch."),
    }


def wire_from_dict(data: object) -> WireDtypes:
    """The inverse of wire_to_dict; PlanError for anything else (a plan file's "wire")."""
    if not isinstance(data, dict) or set(data) != {"forward", "backward"}:
        raise PlanError(
            f"a plan's wire: expected {{'forward': DTYPE, 'backward': DTYPE}}, got {data!r}"
        )
    forward, backward = (getattr(torch, str(data[key]), None) for key in ("forward", "backward"))
    if not isinstance(forward, torch.dtype) or not isinstance(backward, torch.dtype):
        raise PlanError(f"a plan's wire: unknown torch dtype names in {data!r}")
    return WireDtypes(forward, backward)


def limited(dtype: torch.dtype) -> bool:
    """Whether `dtype` holds less than float32's range (its exchange carries overflow flags;
    bfloat16 shares float32's exponent)."""
    return dtype != torch.float32 and torch.finfo(dtype).max < 1e30


def flag_bytes(dtype: torch.dtype) -> int:
    """Bytes of the overflow flag a sender adds for each other rank (0: no flag)."""
    return dtype.itemsize if limited(dtype) else 0
