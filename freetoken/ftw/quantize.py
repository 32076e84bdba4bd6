"""`create --quantize`: expert banks quantized while a model is written to FTW.

Every converter (Hugging Face directory, GGUF file, an FTW model already in the store) passes
its banks through a `BankQuantizer`; dense weights are written as they are (the runtime
computes them in BF16: no kernel reads a packed dense weight yet, so packing them would
lose precision and save no memory where it matters).
"""

from __future__ import annotations

import torch

from freetoken import quant
from freetoken.ftw import FtwError
from freetoken.quant.quantize import expert_format, quantize

__all__ = ["BankQuantizer", "check_quantize"]

MATRICES = ("gate_up", "down")
_EXPERTS_AT_ONCE = 8  # a bank is quantized a few experts at a time: fp32 temporaries stay small


def check_quantize(qtype: str | None) -> str | None:
    """The quantization's canonical spelling, or None; an unknown one is an FtwError."""
    try:
        return quant.quantize_type(qtype) if qtype else None
    except quant.QuantError as e:
        raise FtwError(str(e)) from None


class BankQuantizer:
    """Quantizes float expert banks under `qtype` (None: passes everything through)."""

    def __init__(self, qtype: str | None, layers: list[int]):
        self.qtype = check_quantize(qtype)
        self.position = {layer: i for i, layer in enumerate(sorted(layers))}

    def __call__(
        self, layer: int, bank: str, t: torch.Tensor, fmt: str | None
    ) -> tuple[torch.Tensor, str | None]:
        """(the bank to write, its format)."""
        if self.qtype is None or bank not in MATRICES:
            return t, fmt
        if fmt:
            raise FtwError(
                f"layer {layer}'s {bank} experts are already quantized ({fmt}): quantizing "
                "needs a BF16, F16 or F32 model"
            )
        want = expert_format(
            self.qtype, bank, self.position[layer], len(self.position), t.shape[-1]
        )
        if want is None:
            return t, None
        parts = [
            quantize(t[i : i + _EXPERTS_AT_ONCE], want) for i in range(0, len(t), _EXPERTS_AT_ONCE)
        ]
        return torch.cat(parts), want
