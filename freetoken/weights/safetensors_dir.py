"""A Hugging Face checkpoint directory (config.json + *.safetensors) as ModelWeights.

This is the slow path: expert pieces scattered over the checkpoint are gathered into
[E, ...] banks at load time, one (layer, bank) at a time. FTW stores the banks ready-made;
the converter walks the same `Checkpoint` to write them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from freetoken.models.base import ExpertKey
from freetoken.models.hub import num_experts
from freetoken.weights import BankKey, ModelWeights, WeightsError
from freetoken.weights.experts import assemble


def safetensors_files(files: dict[str, Path]) -> list[Path]:
    """The weight files, in the order the index lists them (or sorted)."""
    index = files.get("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        names = list(dict.fromkeys(weight_map.values()))
        missing = [n for n in names if n not in files]
        if missing:
            raise WeightsError(
                f"checkpoint index names files that are missing: {', '.join(missing)}"
            )
        return [Path(files[n]) for n in names]
    found = sorted(n for n in files if n.endswith(".safetensors"))
    if not found:
        raise WeightsError("no *.safetensors weights in the model")
    return [Path(files[n]) for n in found]


# bytes per element of safetensors' dtype names
_ITEM_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}
_ITEM_BYTES |= {"U8": 1, "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _refuse_quantized(config: dict) -> None:
    """Quantized checkpoints (MXFP4, FP8) hold packed blocks and scales no kernel reads yet:
    refused before a tensor is read, rather than failing on their tensor names later."""
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method:
        raise WeightsError(
            f"the checkpoint's weights are {method}-quantized (quantization_config), which is "
            "not supported yet: use its BF16 form"
        )


class Checkpoint:
    """Open safetensors files, with tensor names sorted into dense weights and expert pieces.

    `model_cls` is the model file's `Model` (models/base.py, ModelFile): its `expert_key`
    says which tensors are expert pieces, `dense_key` what the model calls the others and
    `ignored` which it does not use.
    """

    def __init__(self, files: dict[str, Path], model_cls: type, dtype: torch.dtype | None = None):
        self.config = json.loads(Path(files["config.json"]).read_text())
        _refuse_quantized(self.config)
        self.experts = num_experts(self.config)
        self.dtype = dtype
        self.dense_key = model_cls.dense_key
        self._stack = ExitStack()
        self.handles: dict[str, object] = {}
        self.dense: list[str] = []
        self.pieces: dict[BankKey, list[tuple[str, ExpertKey]]] = defaultdict(list)
        for path in safetensors_files(files):
            f = self._stack.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():
                if model_cls.ignored(name, self.config):
                    continue
                self.handles[name] = f
                key = model_cls.expert_key(name)
                if key is None:
                    self.dense.append(name)
                else:
                    self.pieces[(key.layer, key.bank)].append((name, key))

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tensor(self, name: str) -> torch.Tensor:
        t = self.handles[name].get_tensor(name)
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def nbytes(self) -> int:
        """Bytes of the tensors the model reads (those it ignores not counted), as stored."""
        total = 0
        for name, f in self.handles.items():
            piece = f.get_slice(name)
            n = 1
            for d in piece.get_shape():
                n *= d
            total += n * _ITEM_BYTES[piece.get_dtype()]
        return total

    def bank_keys(self) -> list[BankKey]:
        return sorted(self.pieces)

    def bank(self, key: BankKey) -> torch.Tensor:
        """The [E, ...] bank assembled from its per-expert (or already fused) pieces."""
        pieces = ((self.tensor(name), k) for name, k in self.pieces[key])
        return assemble(pieces, self.experts, f"experts of layer {key[0]} bank {key[1]}")

    def dense_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Dense tensors under the model's own names."""
        for name in self.dense:
            yield self.dense_key(name), self.tensor(name)


def read(files: dict[str, Path], model_cls: type, dtype: torch.dtype | None = None) -> ModelWeights:
    with Checkpoint(files, model_cls, dtype) as ck:
        weights = ModelWeights(config=ck.config, source="safetensors")
        weights.dense = dict(ck.dense_items())
        weights.banks = {key: ck.bank(key) for key in ck.bank_keys()}
    return weights
