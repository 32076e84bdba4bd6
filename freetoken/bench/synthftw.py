"""A random model of a benchmark shape written straight to FTW, its experts already packed.

The full Qwen3-30B-A3B shape is 61 GB in BF16: its checkpoint and the FTW made from it do
not fit a 64 GB disk together, and a quantized model of that shape is what users run
anyway. Here the dense weights come from a random checkpoint written without its routed
experts (tools/synth.py, about 3 GB), read under the model's own names; each expert bank is
random blocks in the format `create --quantize` would choose (bench/packed.py: valid
scales, so every output is finite), generated and written one bank at a time. The result
is an FTW directory that `freetoken create` takes as it takes any, at about the size of the
quantized model.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

from freetoken import models
from freetoken.bench import packed
from freetoken.ftw import convert
from freetoken.ftw.writer import Writer
from freetoken.models import hub
from freetoken.moe import setup
from freetoken.weights import safetensors_dir

__all__ = ["write"]


def write(
    out: Path,
    config: dict[str, Any],
    quantize: str,
    dtype: str = "bfloat16",
    embed_std: float = 0.0,
    seed: int = 0,
) -> Path:
    """FTW of a random model of Hub-style `config` (Qwen3-MoE), its experts packed as
    `quantize` (a quantize type such as q4_K_M, or a block format) would pack them."""
    from freetoken.bench import synthmodel
    from freetoken.tools import synth

    skeleton = out.with_name(out.name + ".dense")
    shutil.rmtree(skeleton, ignore_errors=True)
    synth.write_checkpoint(skeleton, config, dtype, embed_std, experts=False)
    try:
        files = convert.files_of_dir(skeleton)
        cfg = hub.read_config(files)
        cls = models.load_class(cfg)
        with torch.device("meta"):
            shell = cls.from_config(cfg)  # for its experts' shapes only
        spec, layers = setup.expert_spec(shell), list(shell.moe_layers)
        formats = synthmodel.formats_for(quantize, layers, spec)
        writer = Writer(out)
        try:
            with safetensors_dir.Checkpoint(files, cls) as ck:
                for name, t, fmt in ck.dense_items():
                    writer.add_dense(name, t, fmt)
            _banks(writer, layers, spec, hub.num_experts(cfg), formats, dtype, seed)
            meta = {
                "model_type": cfg.get("model_type"),
                "model_info": cls.model_info(cfg),
                "source": {"format": "synthetic", "fingerprint": convert.fingerprint(files)},
                "quantize": quantize,
            }
            return writer.close(meta, convert.metadata_files(files))
        except BaseException:
            writer.abort()
            raise
    finally:
        shutil.rmtree(skeleton, ignore_errors=True)


def _banks(
    writer: Writer, layers: list[int], spec, experts: int, formats: dict, dtype: str, seed: int
) -> None:
    """Each layer's banks: random blocks where a format packs them, else randn·0.02."""
    g = torch.Generator().manual_seed(seed)
    for layer in layers:
        for bank, rows in spec.rows().items():
            shape = (experts, *rows)
            fmt = formats.get((layer, bank))
            if fmt:
                t = packed.random_packed(shape, fmt, g, torch.device("cpu"))
            else:
                n = math.prod(shape)
                t = (torch.randn(n, generator=g) * 0.02).to(getattr(torch, dtype)).view(shape)
            writer.add_bank(layer, bank, t, fmt)
