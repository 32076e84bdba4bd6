"""The loader contract: every weight source yields dense tensors and expert banks.

Dense tensors carry the model's own parameter names; expert banks are one tensor per
(layer, bank) shaped [E, ...] in the layout the expert kernels consume. Safetensors
directories, FTW files and GGUF files are only different sources behind this contract.
A tensor in a block format (freetoken/quant) is packed, uint8 [..., row_bytes], and
`formats` names its format under the same key (a dense name, or a bank's (layer, bank)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

BankKey = tuple[int, str]  # (layer, "gate_up" | "down")


class WeightsError(ValueError):
    """A checkpoint is missing tensors, has unexpected ones, or has the wrong shapes."""


@dataclass
class ModelWeights:
    config: dict[str, Any]
    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    banks: dict[BankKey, torch.Tensor] = field(default_factory=dict)
    source: str = ""
    formats: dict[str | BankKey, str] = field(default_factory=dict)
