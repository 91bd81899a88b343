"""Half-precision exchanges: the pooled outputs and the output gradients sent in 16 or 8 bits.

    emb = shard_embeddings(ebc, strategy, plan, optimizer,
                           wire_dtype=WireDtypes(forward=torch.float16, backward=torch.bfloat16))

The two largest exchanges of a step (exchange.py: 3, the pooled rows back to each rank, and 4,
their gradient to the owners) are cast to the wire dtype right before their all_to_all and back
to float32 right after it, so every sum and update stays float32; only the values that travel
are rounded, once each (a rank's own part never travels and is not rounded). The ids, the size
header, the data-parallel tables' all_reduce (a sum, which a half dtype would round once per
rank) and a 2-D mesh's replica combine stay as they are.

- forward: float32, float16, bfloat16, float8_e4m3fn or float8_e5m2. Dtypes narrower in range
  than float32 (float16: |x| <= 65504; e4m3fn: 448; e5m2: 57344) carry one flag per pair of
  ranks beside the values: a sender whose pooled values fall outside the range raises its flag,
  and every rank of the shard group then raises NonFiniteError (naming the sending ranks; the
  sender's also names its tables) after the exchange completed, so no rank waits on another.
  Clamping would make the values silently wrong; scaling would cost a pass and a scale per row.
- backward: float32 or bfloat16. Gradients need float32's range (a loss over a large batch
  gives values far below float16's smallest normal, 6.1e-5): bfloat16 keeps it in 16 bits, so
  float16 and 8-bit gradients are refused rather than silently flushed to zero.

8-bit values travel as their raw bytes (a uint8 view): an all_to_all only moves bytes, and
gloo (and older NCCL) refuse float8 tensors. Costs and bounds: docs/embeddings-training.md, "Half-
precision exchanges".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from manualpar.embeddings.config import BUILDER
from manualpar.embeddings.exchange_layout import (  # (the planner prices them too)
    BACKWARD_DTYPES,
    FLOAT32_WIRE,
    FORWARD_DTYPES,
    WIRE_NAMES,
    WireDtypes,
    flag_bytes,
    limited,
)
from manualpar.errors import BuilderError, NonFiniteError

if TYPE_CHECKING:
    from manualpar.embeddings.step.parts import StepParts

__all__ = [
    "BACKWARD_DTYPES",
    "FLOAT32_WIRE",
    "FORWARD_DTYPES",
    "WIRE_NAMES",
    "Arriving",
    "WireDtypes",
    "flag_bytes",
    "start_on_wire",
    "wire_dtypes",
]


def wire_dtypes(value: torch.dtype | WireDtypes | str | None) -> WireDtypes:
    """`shard_embeddings(wire_dtype=...)`: None (float32), one dtype for both exchanges, a
    WireDtypes, or a short name of WIRE_NAMES ("bf16": what a command line passes);
    BuilderError for a dtype an exchange cannot carry (see above) or an unknown name."""
    if value is None:
        return FLOAT32_WIRE
    if isinstance(value, str):
        if value not in WIRE_NAMES:
            raise BuilderError(
                f"{BUILDER}(): wire_dtype={value!r} is not a wire dtype name; use one of "
                f"{sorted(WIRE_NAMES)}, a torch dtype or WireDtypes(forward=, backward=)"
            )
        return WIRE_NAMES[value]
    wire = WireDtypes(value, value) if isinstance(value, torch.dtype) else value
    if not isinstance(wire, WireDtypes):
        raise BuilderError(
            f"{BUILDER}(): wire_dtype takes a torch dtype, WireDtypes(forward=, backward=) or "
            f"one of {sorted(WIRE_NAMES)}, got {type(value).__name__}"
        )
    if wire.forward not in FORWARD_DTYPES:
        raise BuilderError(
            f"{BUILDER}(): the pooled outputs cannot travel in {wire.forward}; use one of "
            f"{_names(FORWARD_DTYPES)}"
        )
    if wire.backward not in BACKWARD_DTYPES:
        raise BuilderError(
            f"{BUILDER}(): the output gradients cannot travel in {wire.backward}: gradients "
            "need float32's range (values of a loss over a large batch lie far below "
            "float16's smallest normal 6.1e-5, and 8-bit floats would flush them to zero). "
            f"Use one of {_names(BACKWARD_DTYPES)}: bfloat16 halves the bytes and keeps the "
            "range, e.g. WireDtypes(forward=torch.float16, backward=torch.bfloat16)"
        )
    return wire


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d) for d in dtypes)


class Arriving(Protocol):
    """An exchange in flight; `wait()` gives what arrived, in float32."""

    def wait(self) -> torch.Tensor: ...


def start_on_wire(
    parts: StepParts,
    flat: torch.Tensor,
    send: list[int],
    receive: list[int],
    what: str,
    dtype: torch.dtype,
    culprits: Callable[[], list[str]] | None = None,
) -> Arriving:
    """Start one of the step's exchanges with its values in `dtype` (float32: exactly the plain
    exchange). `culprits`: the tables whose values overflow a limited dtype, asked only on an
    overflow, for the error. Where no table is routed nothing travels, no flag either
    (StepParts.exchange: every rank skips it)."""
    if dtype == torch.float32 or not parts.routes_any:
        return parts.exchange(flat, send, receive, what)
    me = parts.routing.rank
    flags = [int(limited(dtype) and d != me) for d in range(len(send))]
    # on the device: the sender does not wait for it (the receivers read it with the values)
    overflow = (flat.abs() > torch.finfo(dtype).max).any().reshape(1) if limited(dtype) else None
    wire = _interleave(flat, send, flags, overflow, dtype)
    sending = [s + f for s, f in zip(send, flags, strict=True)]
    receiving = [r + f for r, f in zip(receive, flags, strict=True)]
    if dtype.itemsize == 1:  # as raw bytes: no backend needs to know the dtype
        wire = wire.view(torch.uint8)
    pending = parts.exchange(wire, sending, receiving, what)
    return _OnWire(parts, pending, dtype, receive, flags, what, overflow, culprits)


def _interleave(
    flat: torch.Tensor,
    send: list[int],
    flags: list[int],
    flag: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`flat` cast to `dtype`, with `flag` (1 element) after each destination's values where
    `flags` says (one copy: the cast writes into place)."""
    wire = torch.empty(flat.numel() + sum(flags), dtype=dtype, device=flat.device)
    if flag is None or not any(flags):
        return wire.copy_(flat)
    flag = flag.to(torch.float32)
    source = target = 0
    for size, flagged in zip(send, flags, strict=True):
        wire[target : target + size].copy_(flat[source : source + size])
        source, target = source + size, target + size
        if flagged:
            wire[target : target + 1].copy_(flag)
            target += 1
    return wire


@dataclass
class _OnWire:
    """A half-precision exchange in flight: `wait()` casts what arrived back to float32, takes
    the flags out, and raises if any sender's values overflowed (ours included)."""

    parts: StepParts
    pending: Arriving
    dtype: torch.dtype
    receive: list[int]  # float32 values from each sender, flags not counted
    flags: list[int]  # 1 where a sender adds a flag
    what: str
    overflow: torch.Tensor | None  # ours, on the device (None: a dtype with float32's range)
    culprits: Callable[[], list[str]] | None

    def wait(self) -> torch.Tensor:
        arrived = self.pending.wait()
        if self.dtype.itemsize == 1:
            arrived = arrived.view(self.dtype)
        if self.overflow is None or not any(self.flags):
            if self.overflow is not None and bool(self.overflow):  # a group of one
                self._raise([], True)
            return arrived.to(torch.float32)
        values = torch.empty(sum(self.receive), dtype=torch.float32, device=arrived.device)
        at: list[int] = []  # where each flag arrived
        source = target = 0
        for size, flagged in zip(self.receive, self.flags, strict=True):
            values[target : target + size].copy_(arrived[source : source + size])
            source, target = source + size, target + size
            at.append(source if flagged else -1)
            source += flagged
        raised = torch.cat([arrived[[a for a in at if a >= 0]].float(), self.overflow.float()])
        *theirs, ours = raised.tolist()  # one read for every flag
        if any(theirs) or ours:
            senders = iter(theirs)
            self._raise([s for s, a in enumerate(at) if a >= 0 and next(senders)], bool(ours))
        return values

    def _raise(self, senders: list[int], overflow: bool) -> None:
        me = self.parts.routing.rank
        ranks = sorted({*senders, *([me] if overflow else [])})
        tables = self.culprits() if overflow and self.culprits is not None else []
        ours = (
            f"; this rank's tables: {', '.join(map(repr, tables))}"
            if overflow
            else " (their errors name the tables)"
        )
        name = str(self.dtype).removeprefix("torch.")
        raise NonFiniteError(
            f"{BUILDER}: the {self.what} exchanged in {name} holds values beyond its range "
            f"(|value| > {torch.finfo(self.dtype).max:g}) from shard-group rank "
            f"{', '.join(map(str, ranks))}{ours}. They would arrive as inf or saturated, so "
            "every rank of the group stops here, before anything is updated. Send the pooled "
            "outputs in bfloat16 (float32's range in 16 bits: shard_embeddings(..., "
            "wire_dtype=WireDtypes(forward=torch.bfloat16, backward=...))) or float32, or keep "
            "the pooled values smaller (rows, per-id weights, long sum-pooled bags)"
        )
