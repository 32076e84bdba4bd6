"""A Hugging Face checkpoint directory (config.json + *.safetensors) as ModelWeights.

This is the slow path: expert pieces scattered over the checkpoint are gathered into
[E, ...] banks at load time. FTW stores the banks ready-made.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from freetoken.models import num_experts
from freetoken.models.base import ExpertKey
from freetoken.weights import BankKey, ModelWeights, WeightsError


def safetensors_files(files: dict[str, Path]) -> list[Path]:
    """The weight files, in the order the index lists them (or sorted)."""
    index = files.get("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        names = list(dict.fromkeys(weight_map.values()))
        missing = [n for n in names if n not in files]
        if missing:
            raise WeightsError(f"checkpoint index names files that are missing: {', '.join(missing)}")
        return [Path(files[n]) for n in names]
    found = sorted(n for n in files if n.endswith(".safetensors"))
    if not found:
        raise WeightsError("no *.safetensors weights in the model")
    return [Path(files[n]) for n in found]


class _BankBuilder:
    def __init__(self, experts: int, dtype: torch.dtype | None):
        self.experts, self.dtype = experts, dtype
        self.banks: dict[BankKey, torch.Tensor] = {}
        self.filled: dict[BankKey, int] = {}

    def add(self, key: ExpertKey, t: torch.Tensor) -> None:
        bk = (key.layer, key.bank)
        dtype = self.dtype or t.dtype
        if key.expert is None:
            if t.shape[0] != self.experts:
                raise WeightsError(f"bank {bk} has {t.shape[0]} experts, config says {self.experts}")
            self.banks[bk] = t.to(dtype).contiguous()
            self.filled[bk] = self.experts * 2
            return
        rows = t.shape[0] * (2 if key.half is not None else 1)
        bank = self.banks.get(bk)
        if bank is None:
            bank = self.banks[bk] = torch.empty((self.experts, rows, t.shape[1]), dtype=dtype)
        if key.half is None:
            bank[key.expert].copy_(t)
            self.filled[bk] = self.filled.get(bk, 0) + 2
        else:
            n = t.shape[0]
            bank[key.expert, key.half * n:(key.half + 1) * n].copy_(t)
            self.filled[bk] = self.filled.get(bk, 0) + 1

    def check(self) -> None:
        for bk, n in self.filled.items():
            if n != self.experts * 2:
                raise WeightsError(f"experts of layer {bk[0]} bank {bk[1]} are incomplete in the checkpoint")


def read(files: dict[str, Path], expert_key: Callable[[str], ExpertKey | None],
         dtype: torch.dtype | None = None) -> ModelWeights:
    config = json.loads(Path(files["config.json"]).read_text())
    builder = _BankBuilder(num_experts(config), dtype)
    dense: dict[str, torch.Tensor] = {}
    for path in safetensors_files(files):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                key = expert_key(name)
                if key is None:
                    dense[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
                else:
                    builder.add(key, t)
    builder.check()
    return ModelWeights(config=config, dense=dense, banks=builder.banks, source="safetensors")
