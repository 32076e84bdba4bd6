"""Expert banks assembled from checkpoint pieces, whatever layout the checkpoint uses.

A bank is one [E, ...] tensor per (layer, bank) in the layout the kernels consume
(models/base.py, ExpertKey). Checkpoints store it whole, as gate and up halves, or one piece
per expert (and half), possibly transposed or with gate and up rows interleaved; the model
file's ExpertKey says which, and this module turns any of them into the bank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from freetoken.models.base import ExpertKey
from freetoken.weights import WeightsError

__all__ = ["assemble"]


def _normal(t: torch.Tensor, key: ExpertKey) -> torch.Tensor:
    """A piece in the bank's orientation, gate rows before up rows."""
    if key.transposed:
        t = t.transpose(-1, -2)
    if key.interleaved:
        axis = 0 if key.expert is not None else 1  # the 2I axis
        n = t.shape[axis]
        gate = t.index_select(axis, torch.arange(0, n, 2))
        up = t.index_select(axis, torch.arange(1, n, 2))
        t = torch.cat([gate, up], dim=axis)
    return t


def assemble(
    pieces: Iterable[tuple[torch.Tensor, ExpertKey]],
    num_experts: int,
    where: str,
    packed: bool = False,
) -> torch.Tensor:
    """The [E, ...] bank from its pieces (each a tensor and the key naming where it goes).

    packed: the pieces hold quantized blocks (freetoken/quant), whose rows can move but whose
    last dimension cannot be transposed."""
    pieces = list(pieces)
    if packed and any(k.transposed for _, k in pieces):
        raise WeightsError(f"{where}: quantized blocks stored transposed cannot be read")
    pieces = [(_normal(t, k), k) for t, k in pieces]
    if not pieces:
        raise WeightsError(f"{where}: no tensors")
    whole = [(t, k) for t, k in pieces if k.expert is None]
    if whole:
        if len(whole) != len(pieces):
            raise WeightsError(f"{where}: mixes whole-bank and per-expert tensors")
        halves = {k.half: t for t, k in whole}
        if set(halves) == {None}:
            bank = halves[None]
        elif set(halves) == {0, 1}:
            bank = torch.cat([halves[0], halves[1]], dim=1)
        else:
            raise WeightsError(f"{where}: lacks its gate or up half")
        if bank.shape[0] != num_experts:
            raise WeightsError(f"{where}: {bank.shape[0]} experts, config says {num_experts}")
        return bank.contiguous()
    return _per_expert(pieces, num_experts, where)


def _per_expert(
    pieces: list[tuple[torch.Tensor, ExpertKey]], num_experts: int, where: str
) -> torch.Tensor:
    first, k0 = pieces[0]
    rows = first.shape[0] * (2 if k0.half is not None else 1)
    bank = torch.empty((num_experts, rows, *first.shape[1:]), dtype=first.dtype)
    filled = set()
    for t, k in pieces:
        if not 0 <= k.expert < num_experts:
            raise WeightsError(f"{where}: expert {k.expert} of {num_experts}")
        lo = 0 if k.half is None else k.half * t.shape[0]
        bank[k.expert, lo : lo + t.shape[0]].copy_(t)
        filled |= {(k.expert, 0), (k.expert, 1)} if k.half is None else {(k.expert, k.half)}
    if len(filled) != num_experts * 2:
        raise WeightsError(f"{where}: the experts are incomplete in the checkpoint")
    return bank
