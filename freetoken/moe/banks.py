"""Host expert banks: the source of truth for every expert, for the runner's whole life.

GPU slots are only a cache of these. On CUDA machines the banks are page-locked so the GPU
can copy from them asynchronously at full PCIe speed; banks from FTW arrive already pinned.
"""

from __future__ import annotations

import logging

import torch

from freetoken.ftw.hostmem import HostBuffer, Pinner
from freetoken.weights import BankKey

log = logging.getLogger(__name__)


def _host_buffer(t: torch.Tensor) -> HostBuffer | None:
    return getattr(t, "_ft_host_buffer", None)


class HostBanks:
    """banks[layer] = (gate_up [E, 2I, H], down [E, H, I]) in host memory."""

    def __init__(self, banks: dict[BankKey, torch.Tensor], dtype: torch.dtype, pin: bool):
        self.banks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        pinner = Pinner() if pin else None
        for layer in sorted({l for l, _ in banks}):
            gu, dn = (self._prepare(banks[(layer, b)], dtype, pinner) for b in ("gate_up", "down"))
            self.banks[layer] = (gu, dn)
        if pinner is not None:
            pinner.finish()
        first = next(iter(self.banks.values()))
        self.num_experts = first[0].shape[0]
        self.rows = {"gate_up": tuple(first[0].shape[1:]), "down": tuple(first[1].shape[1:])}
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
    def layers(self) -> list[int]:
        return list(self.banks)

    @property
    def expert_bytes(self) -> int:
        gu, dn = next(iter(self.banks.values()))
        return (gu[0].numel() + dn[0].numel()) * gu.element_size()

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self.num_experts * len(self.banks)
