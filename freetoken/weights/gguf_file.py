"""A GGUF file as ModelWeights, plus the config and tokenizer files it implies.

Tensors of types the runtime has no kernel for are dequantized (and the log says so);
float types are taken as they are. The tokenizer is rebuilt from the GGUF vocabulary and
merges as a `tokenizers` byte-level BPE, with the chat template GGUF carries.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freetoken import models
from freetoken.models.base import ExpertKey
from freetoken.models.hub import num_experts
from freetoken.weights import BankKey, ModelWeights, WeightsError
from freetoken.weights.experts import assemble

log = logging.getLogger(__name__)

# llama.cpp's split regex for the Qwen2/Qwen3 tokenizers ("tokenizer.ggml.pre" = qwen2).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
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
    config = cls.config_from_gguf(kv, arch)
    names = {t.name for t in reader.tensors}
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


def keyed_tensors(reader, cls: type) -> Iterator[tuple[str, object, str | ExpertKey]]:
    """Every tensor of the file with the model's key for it: a dense name or an ExpertKey."""
    for t in reader.tensors:
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
    for _, t, key in keyed_tensors(reader, cls):
        if isinstance(key, ExpertKey):
            pieces[(key.layer, key.bank)].append((t, key))
        else:
            tensor = tensor_of(t)
            weights.dense[key] = tensor if dtype is None else tensor.to(dtype)
    experts = num_experts(weights.config)
    weights.banks = dict(banks_of(pieces, experts, path, dtype))
    return weights


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    if pre in ("qwen2", "qwen35", "deepseek-llm"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in (None, "default", "gpt-2", "gpt2"):
        log.warning("GGUF pre-tokenizer %r is not known; using the GPT-2 split", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def write_tokenizer_files(path: Path, out: Path) -> list[str]:
    """tokenizer.json, tokenizer_config.json and generation_config.json from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers import models as tmodels

    kv = metadata(_open(path))
    if kv.get("tokenizer.ggml.model") != "gpt2":
        raise WeightsError(
            f"{path}: tokenizer {kv.get('tokenizer.ggml.model')!r} is not supported (gpt2 BPE is)"
        )
    tokens = list(kv["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in kv.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(tmodels.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(kv.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    types = list(kv.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, ty in enumerate(types)
        if ty in (3, 4)
    ]
    tok.add_special_tokens(special)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {k: kv.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[ids["bos"]]
        if ids["bos"] is not None and kv.get("tokenizer.ggml.add_bos_token")
        else None,
        "eos_token": tokens[ids["eos"]] if ids["eos"] is not None else None,
        "add_bos_token": bool(kv.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": kv.get("tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"eos_token_id": [int(ids["eos"])]} if ids["eos"] is not None else {}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
