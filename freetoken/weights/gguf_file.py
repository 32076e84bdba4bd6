"""A GGUF file as ModelWeights, plus the config it implies (the tokenizer files come from
gguf_tokenizer.py).

Tensors of types the runtime has no kernel for are dequantized (and the log says so);
float types are taken as they are. The tokenizer is rebuilt from the GGUF vocabulary and
merges as a `tokenizers` byte-level BPE, with the chat template GGUF carries.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freetoken import models
from freetoken.models.base import GGUF_TENSORS, ExpertKey
from freetoken.models.hub import num_experts
from freetoken.weights import BankKey, ModelWeights, WeightsError
from freetoken.weights.experts import assemble

log = logging.getLogger(__name__)

_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


def _open(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # gguf raises plain ValueError/struct errors on bad files
        raise WeightsError(f"{path}: not a readable GGUF file: {e}") from None


def metadata(reader) -> dict[str, Any]:
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            out[name] = field.contents()
        except Exception:  # unusual field types are not needed for loading
            continue
    return out


def model_class(kv: dict[str, Any]) -> tuple[type, str]:
    arch = kv.get("general.architecture")
    try:
        model_type = models.arch_for_gguf(arch).model_type
    except models.UnsupportedModel as e:
        raise WeightsError(str(e)) from None
    return models.load_class({"model_type": model_type}), arch


def config_of(reader, kv: dict[str, Any]) -> dict[str, Any]:
    cls, arch = model_class(kv)
    names = {t.name for t in reader.tensors}
    config = cls.config_from_gguf({**kv, GGUF_TENSORS: sorted(names)}, arch)
    config["vocab_size"] = (
        len(kv.get("tokenizer.ggml.tokens") or []) or _shape(reader, "token_embd.weight")[0]
    )
    config["tie_word_embeddings"] = "output.weight" not in names
    config["torch_dtype"] = "float32"
    eos = kv.get("tokenizer.ggml.eos_token_id")
    config["eos_token_id"] = int(eos) if eos is not None else None
    return config


def _shape(reader, name: str) -> tuple[int, ...]:
    t = next(t for t in reader.tensors if t.name == name)
    return tuple(int(x) for x in reversed(t.shape))


def tensor_of(t) -> torch.Tensor:
    """A GGUF tensor as torch, in its logical shape (outermost dimension first)."""
    shape = tuple(int(x) for x in reversed(t.shape))
    qtype = int(t.tensor_type)
    if qtype in _FLOAT_TYPES:
        if qtype == 30:  # bfloat16: numpy has no such type; reinterpret the raw bytes
            raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).copy())
            return raw.view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(np.array(t.data)).reshape(shape)
    from gguf import quants

    return torch.from_numpy(quants.dequantize(t.data, t.tensor_type)).reshape(shape)


def keyed_tensors(
    reader, cls: type, config: dict[str, Any]
) -> Iterator[tuple[str, object, str | ExpertKey]]:
    """Every tensor of the file the model uses, with the model's key for it: a dense name
    or an ExpertKey."""
    for t in reader.tensors:
        if not cls.ignored(t.name, config):
            yield t.name, t, cls.gguf_key(t.name)


def banks_of(
    pieces: dict[BankKey, list[tuple[object, ExpertKey]]],
    num_experts: int,
    path: Path,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[BankKey, torch.Tensor]]:
    """The banks, one (layer, bank) at a time, from the GGUF tensors that hold them."""
    for bk in sorted(pieces):
        tensors = []
        for t, key in pieces[bk]:
            tensor = tensor_of(t)
            tensors.append((tensor if dtype is None else tensor.to(dtype), key))
        yield bk, assemble(tensors, num_experts, f"{path}: layer {bk[0]} bank {bk[1]}")


def read(path: Path, dtype: torch.dtype | None = None) -> ModelWeights:
    reader = _open(path)
    kv = metadata(reader)
    cls, _ = model_class(kv)
    weights = ModelWeights(config=config_of(reader, kv), source="gguf")
    quantized = sorted(
        {t.tensor_type.name for t in reader.tensors if int(t.tensor_type) not in _FLOAT_TYPES}
    )
    if quantized:
        log.warning(
            "%s: dequantizing %s tensors (no quantized expert kernel for them yet)",
            path.name,
            "/".join(quantized),
        )
    pieces: dict[BankKey, list[tuple[object, ExpertKey]]] = defaultdict(list)
    for _, t, key in keyed_tensors(reader, cls, weights.config):
        if isinstance(key, ExpertKey):
            pieces[(key.layer, key.bank)].append((t, key))
        else:
            tensor = tensor_of(t)
            weights.dense[key] = tensor if dtype is None else tensor.to(dtype)
    experts = num_experts(weights.config)
    weights.banks = dict(banks_of(pieces, experts, path, dtype))
    return weights
