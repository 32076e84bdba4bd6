"""Weights from whichever source a model's files hold, through the one loader contract
(freetoken.weights): FTW (what the store keeps: aligned direct reads), or a GGUF file or a
safetensors directory read whole (the slow path; they are converted to FTW when a model
enters the store). Used by the runner's loader and by the ranks that serve only experts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from freetoken import ftw, gguf_split, models
from freetoken.ftw import reader as ftw_reader
from freetoken.models import hub
from freetoken.models.base import ExpertSpec, uniform_spec
from freetoken.weights import ModelWeights, WeightsError, gguf_file, safetensors_dir

__all__ = [
    "gguf_path",
    "is_quantized",
    "load_banks",
    "pick_device",
    "pick_dtype",
    "read_weights",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(setting: str) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def pick_dtype(
    setting: str, config: dict[str, Any], device: torch.device, quantized: bool = False
) -> torch.dtype:
    """The compute dtype: the setting's, else the checkpoint's, else BF16 for a quantized
    model (fp32 compute would only round its weights' error differently, at twice the cost)."""
    if setting != "auto":
        return _DTYPES[setting]
    if quantized:
        return torch.bfloat16
    stored = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    dtype = _DTYPES.get(stored, torch.bfloat16)
    # fp16 checkpoints overflow in MoE activations more often than bf16 on GPUs.
    return torch.bfloat16 if (device.type == "cuda" and dtype == torch.float16) else dtype


def read_weights(
    files: dict[str, Path],
    model_cls: type,
    dtype: torch.dtype,
    progress: ftw_reader.Progress | None = None,
    experts: tuple[int, int] | None = None,
    dense: bool = True,
    huge_pages: str = "auto",
) -> ModelWeights:
    """Dense tensors and expert banks from whichever source the files hold.

    experts=(lo, hi) keeps only those rows of every bank and dense=False no dense tensors
    (one rank's share, freetoken.dist). FTW reads only what is kept; the other sources are
    read whole first (they are converted to FTW when a model enters the store).
    """
    if "config.json" not in files:
        raise WeightsError("the model has no config.json")
    if ftw.INDEX in files:
        huge = {"on": True, "off": False}.get(huge_pages)  # auto: measured by the reader
        return ftw_reader.read(
            files, progress=progress, experts=experts, dense=dense, huge_pages=huge
        )
    gguf = gguf_path(files)
    if gguf is not None:
        weights = gguf_file.read(gguf, dtype)
    else:
        weights = safetensors_dir.read(files, model_cls, dtype)
    if experts is not None:
        lo, hi = experts
        weights.banks = {key: bank[lo:hi].clone() for key, bank in weights.banks.items()}
    if not dense:
        weights.dense = {}
    return weights


def is_quantized(files: dict[str, Path], config: dict[str, Any]) -> bool:
    """Whether the model keeps packed weights: its FTW index names a block format, or its
    checkpoint says it is quantized (GGUF files say so in their derived config's dtype)."""
    if config.get("quantization_config"):
        return True
    if ftw.INDEX not in files:
        return False
    index = json.loads(Path(files[ftw.INDEX]).read_text())
    return any(t.get("quant") for t in index.get("tensors") or [])


def gguf_path(files: dict[str, Path]) -> Path | None:
    """The GGUF file the model is (the first part of a split one), if it is one."""
    found = {n: p for n, p in files.items() if n.endswith(".gguf")}
    first = next(iter(found)) if len(found) == 1 else gguf_split.first_of(found)
    return Path(found[first]) if first and ftw.INDEX not in files else None


def load_banks(
    files: dict[str, Path],
    device_setting: str,
    dtype_setting: str,
    experts: tuple[int, int],
    huge_pages: str = "auto",
) -> tuple[dict, torch.dtype, ExpertSpec, dict]:
    """Rows [lo, hi) of every expert bank, their dtype, what the experts compute and the
    packed banks' formats, without the dense weights (a rank that serves only experts,
    freetoken.dist)."""
    config = hub.read_config(files)
    device = pick_device(device_setting)
    dtype = pick_dtype(dtype_setting, config, device, is_quantized(files, config))
    cls = models.load_class(config)
    weights = read_weights(files, cls, dtype, experts=experts, dense=False, huge_pages=huge_pages)
    with torch.device("meta"):  # the model's structure alone: nothing is allocated
        spec = uniform_spec(cls.from_config(config).expert_specs())
    return weights.banks, dtype, spec, weights.formats
