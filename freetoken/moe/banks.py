"""Host expert banks: the source of truth for every expert, for the runner's whole life.

GPU slots are only a cache of these. On CUDA machines the banks are page-locked so the GPU
can copy from them asynchronously at full PCIe speed; banks from FTW arrive already pinned.
"""

from __future__ import annotations

import logging

import torch

from freetoken.ftw import hostmem
from freetoken.ftw.hostmem import HostBuffer, Pinner, StagingRing
from freetoken.models.base import ExpertSpec
from freetoken.weights import BankKey, WeightsError

log = logging.getLogger(__name__)


def _host_buffer(t: torch.Tensor) -> HostBuffer | None:
    return getattr(t, "_ft_host_buffer", None)


class HostBanks:
    """banks[layer] = {bank: [E, ...]} in host memory, with the banks `spec` names
    (gate_up [E, 2I, H], down [E, H, I], and biases where the experts have them)."""

    def __init__(
        self,
        banks: dict[BankKey, torch.Tensor],
        dtype: torch.dtype,
        pin: bool,
        spec: ExpertSpec,
    ):
        self.spec = spec
        self.banks: dict[int, dict[str, torch.Tensor]] = {}
        pinner = Pinner() if pin else None
        for layer in sorted({layer for layer, _ in banks}):
            missing = [b for b in spec.banks if (layer, b) not in banks]
            if missing:
                raise WeightsError(f"layer {layer} has no {missing[0]} expert bank")
            self.banks[layer] = {
                b: self._prepare(banks[(layer, b)], dtype, pinner) for b in spec.banks
            }
        if pinner is not None:
            pinner.finish()
        # Pinning refused (a memlock limit, a pin quota): the banks stay pageable, and
        # copies to the GPU go through a small pinned ring instead of failing the load.
        self.ring: StagingRing | None = None
        if pin and hostmem.refused() is not None:
            cuda = torch.cuda.is_available()
            self.ring = StagingRing(torch.device("cuda" if cuda else "cpu"))
        first = next(iter(self.banks.values()))
        self.num_experts = first["gate_up"].shape[0]
        self.rows = {b: tuple(t.shape[1:]) for b, t in first.items()}
        want = spec.rows()
        if self.rows != want:
            raise WeightsError(f"expert banks are shaped {self.rows}; the model expects {want}")
        self.dtype = dtype

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
        """dst (device slots) <- src (rows of a bank), queued on the current stream."""
        if self.ring is not None:
            self.ring.copy(dst, src)
        else:
            dst.copy_(src, non_blocking=non_blocking)

    @property
    def layers(self) -> list[int]:
        return list(self.banks)

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes over every bank: what a fetch moves and the CPU reads."""
        first = next(iter(self.banks.values()))
        return sum(t[0].numel() * t.element_size() for t in first.values())

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self.num_experts * len(self.banks)
