"""Random packed expert banks for benchmarks: blocks of a format made from random bytes.

A kernel's speed does not depend on the values it decodes, so banks of any size are made
at the speed of a random-number generator rather than of a quantizer: random codes, and
scale fields set to plausible values (random ones would make NaNs, infinities and subnormal
numbers that no checkpoint holds, and that some CPUs compute slowly).
"""

from __future__ import annotations

import dataclasses
import math
import struct

import torch

from freetoken import quant
from freetoken.ftw.hostmem import HostBuffer, huge_pages_pay_here
from freetoken.models.base import ExpertSpec

__all__ = ["PackedBanks", "host_copy", "random_packed"]

# byte offset -> bytes of each format's scale fields
_F16 = struct.pack("<e", 0.01)
_SCALES: dict[str, dict[int, bytes]] = {
    "q8_0": {0: _F16},
    "q4_0": {0: _F16},
    "q4_k": {0: _F16, 2: _F16},
    "q5_k": {0: _F16, 2: _F16},
    "q6_k": {208: _F16},
    "mxfp4": {0: bytes([120])},
    "fp8_e4m3": {0: struct.pack("<f", 0.01)},
    "nvfp4": {0: struct.pack("<f", 0.01), 4: bytes([0x38] * 8)},  # group scales e4m3 1.0
}


def random_packed(
    shape: tuple[int, ...], fmt: str, g: torch.Generator, device: torch.device
) -> torch.Tensor:
    """Random blocks for a bank of logical `shape` ([E, rows, cols]) packed in `fmt`, made on
    `device` (uint8 [E, rows, row_bytes])."""
    f = quant.get(fmt)
    packed = f.packed_shape(shape)
    raw = torch.randint(0, 256, (math.prod(packed),), generator=g, device=device, dtype=torch.uint8)
    blocks = raw.view(-1, f.block_bytes)
    if fmt == "fp8_e4m3":
        blocks[:, 4:] &= 0xBF  # exponents below the top: no NaN codes
    for at, value in _SCALES[fmt].items():
        field = torch.tensor(list(value), dtype=torch.uint8, device=device)
        blocks[:, at : at + len(value)] = field
    return raw.view(packed)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """t in a fresh page-aligned host mapping, of the pages banks read from FTW get here:
    the kernel read Q4_K banks 6 % faster from huge pages (development VM, two threads)."""
    n = t.numel() * t.element_size()
    buf = HostBuffer(n, huge_pages_pay_here())
    host = buf.tensor(str(t.dtype).removeprefix("torch."), list(t.shape), n)
    host.copy_(t)
    return host


@dataclasses.dataclass
class PackedBanks:
    """Layers of banks in one format, shaped like `bench bw`'s BF16 ones (bw.Banks)."""

    spec: ExpertSpec
    layers: list[dict[str, torch.Tensor]]
    expert_bytes: int

    @classmethod
    def make(cls, fmt: str, E: int, H: int, I: int, layers: int) -> PackedBanks:
        """Unpinned: the CPU kernel is what they are measured with."""
        spec = ExpertSpec(H, I, formats=(fmt, fmt))
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        g = torch.Generator(device=dev).manual_seed(0)
        made = [
            {b: host_copy(random_packed((E, *r), fmt, g, dev)) for b, r in spec.rows().items()}
            for _ in range(layers)
        ]
        per = sum(math.prod(s) for s in spec.stored_rows().values())
        return cls(spec, made, per)
