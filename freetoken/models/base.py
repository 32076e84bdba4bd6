"""Types shared by model files and the weight loader (kept free of torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExpertKey:
    """Where a checkpoint tensor lands in the expert banks.

    bank: "gate_up" ([E, 2I, H], gate rows first) or "down" ([E, H, I]).
    expert: the expert index for per-expert tensors; None when the tensor is the whole bank.
    half: for per-expert gate/up tensors, 0 = gate rows [0, I), 1 = up rows [I, 2I).
    """

    layer: int
    bank: str
    expert: int | None = None
    half: int | None = None
