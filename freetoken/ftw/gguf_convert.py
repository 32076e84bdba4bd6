"""GGUF -> FTW: dense tensors under the model's names, experts stacked into banks per layer."""

from __future__ import annotations

import json
import logging
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from freetoken.ftw import DEFAULT_SHARD_LIMIT
from freetoken.ftw.writer import Writer
from freetoken.models.base import ExpertKey
from freetoken.weights import WeightsError, gguf_file

log = logging.getLogger(__name__)


def convert_gguf(
    src: Path,
    out: Path,
    *,
    shard_limit: int = DEFAULT_SHARD_LIMIT,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    reader = gguf_file._open(src)
    kv = gguf_file.metadata(reader)
    cls, _ = gguf_file.model_class(kv)
    config = gguf_file.config_of(reader, kv)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    done = 0
    experts: dict[int, dict[tuple[str, int | None], object]] = defaultdict(dict)
    writer = Writer(out, shard_limit)
    try:
        for t in reader.tensors:
            key = cls.gguf_key(t.name)
            if isinstance(key, ExpertKey):
                experts[key.layer][(key.bank, key.half)] = t
                continue
            writer.add_dense(key, gguf_file.tensor_of(t))
            done += int(t.n_bytes)
            progress and progress(done, total)
        for layer in sorted(experts):
            parts = experts[layer]
            if not {("gate_up", 0), ("gate_up", 1), ("down", None)} <= set(parts):
                raise WeightsError(f"{src}: layer {layer} lacks some of its experts")
            gate, up = (gguf_file.tensor_of(parts[("gate_up", h)]) for h in (0, 1))
            writer.add_bank(layer, "gate_up", torch.cat([gate, up], dim=1))
            writer.add_bank(layer, "down", gguf_file.tensor_of(parts[("down", None)]))
            done += sum(int(p.n_bytes) for p in parts.values())
            progress and progress(done, total)
        with tempfile.TemporaryDirectory() as tmp:
            meta_dir = Path(tmp)
            gguf_file.write_tokenizer_files(src, meta_dir)
            (meta_dir / "config.json").write_text(json.dumps(config, indent=2))
            from freetoken.ftw.convert import fingerprint

            meta = {
                "model_type": config["model_type"],
                "source": {
                    "format": "gguf",
                    "fingerprint": fingerprint({src.name: src}),
                    "files": [src.name],
                },
            }
            return writer.close(meta, {p.name: p for p in meta_dir.iterdir()})
    except BaseException:
        writer.abort()
        raise
