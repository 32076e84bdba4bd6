"""Builds a model from a directory of files through the one loader contract.

Model construction happens on the meta device, so no memory is spent initialising
weights that the checkpoint overwrites; dense weights then land on the compute device and
expert banks are handed to an expert backend.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from freetoken import models
from freetoken.ftw import reader as ftw_reader
from freetoken.ftw.sources import gguf_path, is_quantized, pick_device, pick_dtype, read_weights
from freetoken.layers.computed import reset_buffers
from freetoken.models import hub
from freetoken.moe import setup
from freetoken.moe.setup import Placement
from freetoken.weights import WeightsError

log = logging.getLogger(__name__)


@dataclass
class Loaded:
    model: nn.Module
    config: dict[str, Any]
    device: torch.device
    dtype: torch.dtype
    banks: dict = field(default_factory=dict)
    formats: dict = field(default_factory=dict)  # the packed banks' block formats


def with_gguf_metadata(files: dict[str, Path], scratch: Path) -> dict[str, Path]:
    """For a bare GGUF, derive config.json and tokenizer files into `scratch` (the slow path)."""
    gguf = gguf_path(files)
    if gguf is None or "config.json" in files:
        return files
    from freetoken.weights.gguf_file import _open, config_of, metadata
    from freetoken.weights.gguf_tokenizer import write_tokenizer_files

    reader = _open(gguf)
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "config.json").write_text(json.dumps(config_of(reader, metadata(reader))))
    names = write_tokenizer_files(gguf, scratch)
    return {**files, "config.json": scratch / "config.json", **{n: scratch / n for n in names}}


def _unpacked(t: torch.Tensor, fmt: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A packed dense weight decoded on the device, a slice of rows at a time (the decoding
    runs in fp32: a whole embedding at once would need 4 bytes a weight of room)."""
    from freetoken.kernels.reference import dequantize

    rows = t.reshape(-1, t.shape[-1])
    step = max(1, (64 << 20) // rows.shape[1])
    out = torch.cat([dequantize(r.to(device), fmt).to(dtype) for r in rows.split(step)])
    return out.reshape(*t.shape[:-1], out.shape[-1])


def kept_in_fp32(model: nn.Module, name: str) -> bool:
    """Whether a parameter stays fp32 whatever the model's dtype: the model file's `FP32`
    names (modules or dotted tails: "norm", "gate.weight") as its reference keeps them."""
    return any(f".{part}." in f".{name}." for part in getattr(model, "FP32", ()))


def _load_dense(
    model: nn.Module,
    dense: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    formats: dict | None = None,
) -> None:
    """Dense weights onto the device in the compute dtype: quantized ones are decoded (no
    quantized linear layer reads them packed yet)."""
    formats = formats or {}
    dense = {
        n: _unpacked(t, formats[n], device, dtype) if n in formats else t for n, t in dense.items()
    }
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in dense and not n.endswith("lm_head.weight")]
    if missing:
        raise WeightsError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    unexpected = [n for n in dense if n not in params]
    if unexpected:
        raise WeightsError(
            f"checkpoint has {len(unexpected)} unexpected tensors, e.g. {unexpected[:3]}"
        )
    for name, p in params.items():
        t = dense.get(name)
        if t is None:
            continue
        if tuple(t.shape) != tuple(p.shape):
            raise WeightsError(
                f"{name}: checkpoint shape {tuple(t.shape)} != model {tuple(p.shape)}"
            )
        # integer tensors (a routing table) keep their dtype
        keep = p.dtype if not p.is_floating_point() else dtype
        p.data = t.to(device=device, dtype=torch.float32 if kept_in_fp32(model, name) else keep)


def load(
    files: dict[str, Path],
    device_setting: str = "auto",
    dtype_setting: str = "auto",
    progress: ftw_reader.Progress | None = None,
    experts: tuple[int, int] | None = None,
    huge_pages: str = "auto",
) -> Loaded:
    """The model with its dense weights on the device; the expert banks (rows [lo, hi) of
    each with `experts`) stay in host memory for `place_experts`."""
    if "config.json" not in files:
        raise WeightsError("the model has no config.json")
    config = hub.read_config(files)
    cls = models.load_class(config)
    device = pick_device(device_setting)
    dtype = pick_dtype(dtype_setting, config, device, is_quantized(files, config))
    weights = read_weights(files, cls, dtype, progress, experts, huge_pages=huge_pages)
    with torch.device("meta"):
        model = cls.from_config(config)
    model.to_empty(device=device)
    _load_dense(model, weights.dense, device, dtype, weights.formats)
    if "lm_head.weight" not in weights.dense:
        if not config.get("tie_word_embeddings"):
            raise WeightsError("checkpoint has no lm_head.weight and embeddings are not tied")
        model.tie_weights()
    # buffers (rope frequencies) were created on meta; compute them for real
    reset_buffers(model)
    model.eval()
    log.info(
        "loaded %s (%s) on %s as %s",
        models.arch_for(config).model_type,
        weights.source,
        device,
        dtype,
    )
    formats = {k: f for k, f in weights.formats.items() if k in weights.banks}
    return Loaded(model, config, device, dtype, weights.banks, formats)


def place_experts(loaded: Loaded, placement: Placement, group=None):
    """Installs the experts op backend; call after the KV cache is allocated (it sizes the
    slot pool).

    With a process group (freetoken.dist) the backend spreads the experts over its ranks.
    """
    if group is not None:
        from freetoken.dist import experts as dist_experts

        backend = dist_experts.install(
            loaded.model,
            loaded.banks,
            loaded.device,
            loaded.dtype,
            placement,
            group,
            loaded.formats,
        )
    else:
        backend = setup.install(
            loaded.model, loaded.banks, loaded.device, loaded.dtype, placement, loaded.formats
        )
    loaded.banks = {}  # the backend's host banks own them now
    return backend
