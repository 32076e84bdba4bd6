"""Host expert banks: the source of truth for every expert, for the runner's whole life.

GPU slots are only a cache of these. On CUDA machines the banks are page-locked so the GPU
can copy from them asynchronously at full PCIe speed; banks from FTW arrive already pinned.

Packed banks (freetoken/quant) stay packed: their bytes are what the CPU kernel reads, what
PCIe moves and what the slots hold. Each layer has its own spec, which differs from the
others' only in its banks' formats (a Q4_K_M file keeps some layers' down in Q6_K).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from freetoken.ftw import hostmem
from freetoken.ftw.hostmem import HostBuffer, Pinner, StagingRing
from freetoken.models.base import ExpertSpec
from freetoken.weights import BankKey, WeightsError

log = logging.getLogger(__name__)

MATRICES = ("gate_up", "down")


def _host_buffer(t: torch.Tensor) -> HostBuffer | None:
    return getattr(t, "_ft_host_buffer", None)


class HostBanks:
    """banks[layer] = {bank: [E, ...]} in host memory, with the banks `spec` names
    (gate_up [E, 2I, H], down [E, H, I], and biases where the experts have them), each
    matrix bank packed where `formats` names a block format for it."""

    def __init__(
        self,
        banks: dict[BankKey, torch.Tensor],
        dtype: torch.dtype,
        pin: bool,
        spec: ExpertSpec,
        formats: dict[BankKey, str] | None = None,
    ):
        layers = sorted({layer for layer, _ in banks})
        formats = _one_kind_per_bank(banks, dict(formats or {}), layers)
        self.specs = {
            layer: dataclasses.replace(
                spec, formats=tuple(formats.get((layer, b), "") for b in MATRICES)
            )
            for layer in layers
        }
        self.banks: dict[int, dict[str, torch.Tensor]] = {}
        pinner = Pinner() if pin else None
        for layer in layers:
            missing = [b for b in spec.banks if (layer, b) not in banks]
            if missing:
                raise WeightsError(f"layer {layer} has no {missing[0]} expert bank")
            s = self.specs[layer]
            self.banks[layer] = {
                b: self._prepare(
                    banks[(layer, b)], torch.uint8 if s.format_of(b) else dtype, pinner
                )
                for b in spec.banks
            }
            _check_shapes(layer, self.banks[layer], s)
        if pinner is not None:
            pinner.finish()
        # Pinning refused (a memlock limit, a pin quota): the banks stay pageable, and
        # copies to the GPU go through a small pinned ring instead of failing the load.
        self.ring: StagingRing | None = None
        if pin and hostmem.refused() is not None:
            cuda = torch.cuda.is_available()
            self.ring = StagingRing(torch.device("cuda" if cuda else "cpu"))
        self.num_experts = next(iter(self.banks.values()))["gate_up"].shape[0]
        self.dtype = dtype  # the model's compute dtype: float banks are kept in it
        first = self.banks[layers[0]]
        self.dtypes = {b: t.dtype for b, t in first.items()}
        # a slot holds any layer's expert: each bank's rows as wide as the widest format's
        self.rows = {
            b: max((tuple(self.banks[layer][b].shape[1:]) for layer in layers), key=_numel)
            for b in first
        }

    @staticmethod
    def _prepare(t: torch.Tensor, dtype: torch.dtype, pinner: Pinner | None) -> torch.Tensor:
        buf = _host_buffer(t)
        if t.dtype == dtype and t.is_contiguous() and (pinner is None or buf is not None):
            if pinner is not None and not buf.pinned:
                pinner.submit(buf)
            return t
        # a bank that is not yet in its own page-aligned mapping (safetensors, a cast): copy it
        nbytes = t.numel() * torch.tensor([], dtype=dtype).element_size()
        buf = HostBuffer(nbytes)
        out = buf.tensor(str(dtype).removeprefix("torch."), list(t.shape), nbytes)
        out.copy_(t)
        if pinner is not None:
            pinner.submit(buf)
        return out

    @property
    def pinned(self) -> bool:
        """GPU kernels may read the banks in place (they are registered with CUDA)."""
        return self.ring is None

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        """dst (device slots) <- src (rows of a bank), queued on the current stream. A run
        of packed experts narrower than their slots is strided: the ring takes it a row at
        a time, each row being contiguous."""
        if self.ring is not None and not dst.is_contiguous():
            for d, s in zip(dst, src):
                self.ring.copy(d, s)
        elif self.ring is not None:
            self.ring.copy(dst, src)
        else:
            dst.copy_(src, non_blocking=non_blocking)

    @property
    def layers(self) -> list[int]:
        return list(self.banks)

    @property
    def spec(self) -> ExpertSpec:
        """What every layer's experts compute, whatever their formats (hidden size, activation):
        kernels take the layer's own, `specs[layer]`."""
        return dataclasses.replace(next(iter(self.specs.values())), formats=("", ""))

    def layer_bytes(self, layer: int) -> int:
        """One expert of `layer`, over every bank: what a fetch moves and the CPU reads."""
        return sum(t[0].numel() * t.element_size() for t in self.banks[layer].values())

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes, averaged over the layers (they differ where formats do)."""
        return self.total_bytes // (self.num_experts * len(self.banks))

    @property
    def slot_bytes(self) -> int:
        """What a GPU slot takes: every bank's widest row (models/base.py, stored_rows)."""
        return sum(_numel(s) * self.dtypes[b].itemsize for b, s in self.rows.items())

    @property
    def main_format(self) -> str:
        """The block format holding most of the banks' bytes ("" for float banks)."""
        by_bytes: dict[str, int] = {}
        for layer, banks in self.banks.items():
            for b, t in banks.items():
                fmt = self.specs[layer].format_of(b)
                by_bytes[fmt] = by_bytes.get(fmt, 0) + t.numel() * t.element_size()
        return max(by_bytes, key=by_bytes.__getitem__)

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes(layer) * self.num_experts for layer in self.banks)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_shapes(layer: int, banks: dict[str, torch.Tensor], spec: ExpertSpec) -> None:
    got = {b: tuple(t.shape[1:]) for b, t in banks.items()}
    want = spec.stored_rows()
    if got != want:
        raise WeightsError(
            f"layer {layer}'s expert banks are shaped {got}; the model expects {want}"
        )


def _one_kind_per_bank(
    banks: dict[BankKey, torch.Tensor], formats: dict[BankKey, str], layers: list[int]
) -> dict[BankKey, str]:
    """Formats with every layer of a bank packed, or none: a slot's bytes are packed blocks or
    floats for every layer. A float layer among packed ones (a checkpoint that left one
    unquantized) is packed as Q8_0, which keeps it within 0.5% of its values."""
    from freetoken.quant.quantize import quantize

    for b in MATRICES:
        if not any((layer, b) in formats for layer in layers):
            continue
        for layer in layers:
            key = (layer, b)
            if key not in formats and key in banks:
                log.warning("layer %d's %s experts are not quantized like the others: Q8_0", *key)
                banks[key] = quantize(banks[key], "q8_0")
                formats[key] = "q8_0"
    return formats
