"""What a model asks of a machine, read without loading it: the bytes of its expert banks
and of its dense weights, its shape (layers, experts, experts a token uses), its context
window and its KV bytes a token. From a model in the store (its FTW index), or from a
Hugging Face directory or GGUF file not created yet (estimated from config.json or the
GGUF's tensors, as conversion would lay them out)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken import gguf_split, quant
from freetoken import models as archs
from freetoken.ftw import INDEX
from freetoken.models import hub

__all__ = ["ModelFacts", "from_files", "from_source"]

_BF16 = 2  # bytes per weight after conversion (the store keeps BF16/F16/F32 as given)


@dataclass
class ModelFacts:
    name: str
    bank_bytes: int  # every expert of every MoE layer (host banks)
    dense_bytes: int  # everything else (GPU, or host on a CPU)
    moe_layers: int
    experts: int  # per MoE layer
    experts_per_token: int
    context_length: int  # trained window; 0 when unknown
    kv_bytes_per_token: int  # about: full attention's K and V in 16 bits
    source_bytes: int = 0  # a source not created yet: its files' bytes
    converted: bool = True  # False: `freetoken create` would convert it first

    @property
    def expert_bytes(self) -> int:
        return self.bank_bytes // max(self.moe_layers * self.experts, 1)

    @property
    def total_bytes(self) -> int:
        return self.bank_bytes + self.dense_bytes


def _shape(name: str, config: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    a = info.get("general.architecture", "")
    layers = int(info.get(f"{a}.block_count") or config.get("num_hidden_layers") or 0)
    kv_heads = int(info.get(f"{a}.attention.head_count_kv") or 0)
    head = int(info.get(f"{a}.attention.key_length") or 0)
    return {
        "name": name,
        "experts": int(info.get(f"{a}.expert_count") or hub.num_experts(config)),
        "experts_per_token": int(
            info.get(f"{a}.expert_used_count") or hub.experts_per_token(config)
        ),
        "context_length": int(info.get(f"{a}.context_length") or 0),
        "kv_bytes_per_token": 2 * layers * kv_heads * head * _BF16,
        "moe_layers": layers,
    }


def from_files(name: str, files: dict[str, Path]) -> ModelFacts:
    """A converted model: its config.json and FTW index (the store's or a runner's files)."""
    config = json.loads(Path(files["config.json"]).read_text())
    index = json.loads(Path(files[INDEX]).read_text())
    info = archs.model_info(config, index)
    shape = _shape(name, config, info)
    banks = [t for t in index["tensors"] if t.get("kind") == "bank"]
    shape["moe_layers"] = len({t["layer"] for t in banks}) or shape["moe_layers"]
    bank_bytes = sum(int(t["nbytes"]) for t in banks)  # packed banks stay packed in memory
    dense = sum(_dense_bytes(t) for t in index["tensors"] if t.get("kind") != "bank")
    return ModelFacts(bank_bytes=bank_bytes, dense_bytes=dense, **shape)


def _dense_bytes(t: dict[str, Any]) -> int:
    """A dense tensor's bytes on the device: a packed one is decoded to BF16 at load."""
    if not t.get("quant"):
        return int(t["nbytes"])
    n = 1
    for d in t["shape"]:  # the logical shape (docs/ftw.md)
        n *= int(d)
    return n * _BF16


def from_source(path: Path) -> ModelFacts:
    """A Hugging Face directory or a GGUF file, as `create` would convert it."""
    if path.is_file():
        return _from_gguf(path)
    config = hub.read_config({p.name: p for p in path.iterdir()})
    info = archs.model_info(config)
    shape = _shape(path.name, config, info)
    source = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    a = info.get("general.architecture", "")
    hidden = int(info.get(f"{a}.embedding_length") or 0)
    inter = int(info.get(f"{a}.expert_feed_forward_length") or 0)
    # gate, up and down of every expert, kept in the checkpoint's dtype (F32 stays F32)
    width = 4 if hub.first(config, "torch_dtype", "dtype") == "float32" else _BF16
    weights = 3 * hidden * inter * shape["experts"] * shape["moe_layers"]
    fmt = _kept_format(config)
    if fmt is None:
        banks = weights * width
        total = max(source, archs.parameter_count(config) * width)
    else:  # the experts stay in their blocks; dense weights are decoded to BF16 at load
        banks = int(weights * fmt.bits) // 8
        total = banks + max(archs.parameter_count(config) - weights, 0) * _BF16
    return ModelFacts(
        bank_bytes=min(banks, total),
        dense_bytes=max(total - banks, 0),
        source_bytes=source,
        converted=False,
        **shape,
    )


def _kept_format(config: dict[str, Any]) -> quant.QuantFormat | None:
    """The block format a quantized checkpoint's experts keep (FP8, MXFP4, NVFP4), if any."""
    q = config.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "modelopt" and q.get("quant_algo") != "NVFP4":
        return None
    fmt = quant.CHECKPOINT_METHODS.get(method) if isinstance(method, str) else None
    return quant.get(fmt) if fmt else None


def _from_gguf(path: Path) -> ModelFacts:
    """A GGUF file's facts (every part's, for a split one: its first holds the metadata)."""
    from gguf import GGUFReader

    files = gguf_split.parts(path)
    readers = [GGUFReader(str(p)) for p in files]
    info = {}
    for key, value in readers[0].fields.items():
        if value.types and len(value.data) == 1:
            info[key] = value.contents()
    shape = _shape(path.name, {}, info)
    # GGUF stacks each layer's experts into ffn_*_exps tensors: kept in their blocks where a
    # kernel reads the type, else BF16; dense weights are BF16 on the device either way
    banks = dense = 0
    for t in (t for r in readers for t in r.tensors):
        if "_exps" not in t.name:
            dense += int(t.n_elements) * _BF16
        elif int(t.tensor_type) in quant.GGML_TYPES:
            banks += int(t.n_bytes)
        else:
            banks += int(t.n_elements) * _BF16
    return ModelFacts(
        bank_bytes=banks,
        dense_bytes=dense,
        source_bytes=sum(p.stat().st_size for p in files),
        converted=False,
        **shape,
    )
