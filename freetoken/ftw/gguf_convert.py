"""GGUF -> FTW: dense tensors under the model's names, experts stacked into banks per layer.

Tensors in a block format the kernels read are written as the file holds them (packed);
other quantized types are dequantized to BF16, which the converter announces."""

from __future__ import annotations

import json
import logging
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from freetoken import gguf_split
from freetoken.ftw import DEFAULT_SHARD_LIMIT
from freetoken.ftw.quantize import BankQuantizer
from freetoken.ftw.reader import require_host_memory
from freetoken.ftw.writer import Writer
from freetoken.models.base import ExpertKey
from freetoken.models.hub import num_experts
from freetoken.weights import gguf_file, gguf_tokenizer

log = logging.getLogger(__name__)


def convert_gguf(
    src: Path,
    out: Path,
    *,
    shard_limit: int = DEFAULT_SHARD_LIMIT,
    progress: Callable[[int, int], None] | None = None,
    note: Callable[[str], None] | None = None,
    quantize: str | None = None,
) -> tuple[Path, dict[str, str]]:
    """Writes FTW; returns its directory and each file's digest."""
    reader = gguf_file._open(src)
    kv = gguf_file.metadata(reader)
    cls, _ = gguf_file.model_class(kv)
    config = gguf_file.config_of(reader, kv)
    dequantized = gguf_file.dequantized_types(reader)
    kind = gguf_file.file_type(kv)
    if dequantized and note is not None:
        note(f"dequantizing {'/'.join(dequantized)} tensors to BF16 (no kernel reads them packed)")
    total = sum(int(t.n_bytes) for t in reader.tensors)
    # the file's bytes: what its weights take in memory at least, dequantized or not
    require_host_memory(total, "the model's weights (read into memory to serve)")
    writer = Writer(out, shard_limit)
    try:
        qtype = _write_tensors(writer, reader, cls, src, config, quantize, progress)
        with tempfile.TemporaryDirectory() as tmp:
            meta_dir = Path(tmp)
            gguf_tokenizer.write_tokenizer_files(src, meta_dir)
            (meta_dir / "config.json").write_text(json.dumps(config, indent=2))
            from freetoken.ftw.convert import fingerprint

            parts = {p.name: p for p in gguf_split.parts(src)}
            meta = {
                "model_type": config["model_type"],
                "model_info": cls.model_info(config),
                "source": {
                    "format": "gguf",
                    "fingerprint": fingerprint(parts),
                    "files": sorted(parts),
                    # the file's own name for its mix of types, true of the FTW where
                    # every tensor kept the type it had
                    **({"file_type": kind} if kind and not dequantized else {}),
                },
                **({"quantize": qtype} if qtype else {}),
            }
            out = writer.close(meta, {p.name: p for p in meta_dir.iterdir()})
            return out, writer.digests
    except BaseException:
        writer.abort()
        raise


def _write_tensors(
    writer: Writer,
    reader,
    cls,
    src: Path,
    config: dict,
    quantize: str | None,
    progress: Callable[[int, int], None] | None,
) -> str | None:
    """Writes the dense tensors, then each expert bank (quantized where asked); returns the
    type the banks were quantized to, if any."""
    total = sum(int(t.n_bytes) for t in reader.tensors)
    done = 0
    pieces: dict[tuple[int, str], list] = defaultdict(list)
    for _, t, key in gguf_file.keyed_tensors(reader, cls, config):
        if isinstance(key, ExpertKey):
            pieces[(key.layer, key.bank)].append((t, key))
            continue
        writer.add_dense(key, *gguf_file.dense_of(cls, t, key, config))
        done += int(t.n_bytes)
        progress and progress(done, total)
    banks = BankQuantizer(quantize, [layer for layer, _ in pieces])
    for (layer, bank), tensor, fmt in gguf_file.banks_of(pieces, num_experts(config), src):
        writer.add_bank(layer, bank, *banks(layer, bank, tensor, fmt))
        done += sum(int(t.n_bytes) for t, _ in pieces[(layer, bank)])
        progress and progress(done, total)
    return banks.qtype
