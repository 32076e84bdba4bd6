"""A GGUF file as ModelWeights, plus the config it implies (the tokenizer files come from
gguf_tokenizer.py).

Tensors in a block format the kernels read (freetoken/quant: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K,
MXFP4) stay packed, their bytes as the file has them; float types are taken as they are;
other quantized types are dequantized to BF16 (and the log says so). The file's tensor table
is checked before any tensor is read: a type no one knows, rows that are not whole blocks, or
a tensor whose bytes run into the next one's is an error that names the tensor. The
tokenizer is rebuilt from the GGUF vocabulary and merges as a `tokenizers` byte-level BPE,
with the chat template GGUF carries.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freetoken import gguf_split, models, quant
from freetoken.models.base import GGUF_TENSORS, ExpertKey
from freetoken.models.hub import num_experts
from freetoken.weights import BankKey, ModelWeights, WeightsError
from freetoken.weights.experts import assemble

log = logging.getLogger(__name__)

_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


def _open(path: Path):
    """The file's reader; for a part of a split GGUF, every part's, read as one file."""
    try:
        files = gguf_split.parts(path)
    except gguf_split.MissingParts as e:
        raise WeightsError(str(e)) from None
    readers = [_open_one(p) for p in files]
    return readers[0] if len(readers) == 1 else Parts(files, readers)


def _open_one(path: Path):
    from freetoken.weights.gguf_checks import CheckedReader

    try:
        return CheckedReader(str(path))
    except WeightsError as e:
        raise WeightsError(f"{path.name}: {e}") from None
    except Exception as e:  # gguf raises plain ValueError/struct errors on bad files
        raise WeightsError(f"{path}: not a readable GGUF file: {e}") from None


class Parts:
    """A split GGUF's parts as one reader: the first part's metadata, every part's tensors.
    Each part must say it is that part of that many, and together they must hold the
    tensors the first part counts, each once."""

    def __init__(self, files: list[Path], readers: list) -> None:
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]
        for i, (path, reader) in enumerate(zip(files, readers)):
            said = (_split_key(reader, "no"), _split_key(reader, "count"))
            if said != (i, len(files)):
                raise WeightsError(
                    f"{path.name}: says it is part {said[0]} (from 0) of {said[1]}, "
                    f"not {i} of {len(files)}"
                )
        total = _split_key(readers[0], "tensors.count")
        names = [t.name for t in self.tensors]
        if total != len(names) or len(set(names)) != len(names):
            raise WeightsError(
                f"{files[0].name}: the parts hold {len(set(names))} tensors, not the "
                f"{total} the split counts"
            )


def _split_key(reader, key: str) -> int | None:
    field = reader.fields.get(f"split.{key}")
    return int(field.contents()) if field is not None else None


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


def file_type(kv: dict[str, Any]) -> str | None:
    """The file's type as llama.cpp names it in general.file_type (Q4_K_M, Q8_0, MXFP4_MOE):
    what Ollama reports as the quantization level. None where the file does not say."""
    from gguf import LlamaFileType

    try:
        name = LlamaFileType(int(kv["general.file_type"])).name
    except (KeyError, TypeError, ValueError):
        return None
    return None if name == "GUESSED" else name.removeprefix("MOSTLY_").removeprefix("ALL_")


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
    config["torch_dtype"] = _compute_dtype(reader)
    eos = kv.get("tokenizer.ggml.eos_token_id")
    config["eos_token_id"] = int(eos) if eos is not None else None
    return config


def _compute_dtype(reader) -> str:
    """float32 for a file whose matrices are all F32 (what a converter writes to keep every
    bit), bfloat16 otherwise: quantized and half-precision models compute in BF16 unless the
    dtype setting asks for more."""
    matrices = [t for t in reader.tensors if len(t.shape) > 1]
    return "float32" if all(int(t.tensor_type) == 0 for t in matrices) else "bfloat16"


def _shape(reader, name: str) -> tuple[int, ...]:
    t = next(t for t in reader.tensors if t.name == name)
    return tuple(int(x) for x in reversed(t.shape))


def tensor_of(t) -> tuple[torch.Tensor, str | None]:
    """A GGUF tensor as torch and its block format: packed (uint8, freetoken/quant) for the
    formats the kernels read, float otherwise, in its logical shape (outermost first)."""
    shape = tuple(int(x) for x in reversed(t.shape))
    qtype = int(t.tensor_type)
    if qtype in _FLOAT_TYPES:
        if qtype == 30:  # bfloat16: numpy has no such type; reinterpret the raw bytes
            raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).copy())
            return raw.view(torch.bfloat16).reshape(shape), None
        return torch.from_numpy(np.array(t.data)).reshape(shape), None
    fmt = quant.GGML_TYPES.get(qtype)
    if fmt is not None:
        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))
        return raw.reshape(fmt.packed_shape(shape)), fmt.name
    from gguf import quants

    try:
        values = torch.from_numpy(quants.dequantize(t.data, t.tensor_type)).reshape(shape)
    except NotImplementedError:
        raise WeightsError(
            f"tensor {t.name}: {t.tensor_type.name} is a GGUF type FreeToken cannot read"
        ) from None
    return values.to(torch.bfloat16), None


def dense_of(cls: type, t, key: str, config: dict[str, Any]) -> tuple[torch.Tensor, str | None]:
    """A dense GGUF tensor as the model holds it (`tensor_of`, decoded where the family's
    `gguf_float` asks, then its `gguf_tensor`) and its block format."""
    tensor, fmt = tensor_of(t)
    if fmt and cls.gguf_float(key, config):
        tensor, fmt = _float(tensor, fmt), None
    return cls.gguf_tensor(key, tensor, fmt, config)


def dequantized_types(reader) -> list[str]:
    """The quantized types of the file that no kernel reads: dequantized to BF16."""
    kept = set(_FLOAT_TYPES) | set(quant.GGML_TYPES)
    return sorted({t.tensor_type.name for t in reader.tensors if int(t.tensor_type) not in kept})


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
) -> Iterator[tuple[BankKey, torch.Tensor, str | None]]:
    """The banks, one (layer, bank) at a time, from the GGUF tensors that hold them, with
    their block format (None: float)."""
    for bk in sorted(pieces):
        read = [(*tensor_of(t), key) for t, key in pieces[bk]]
        fmts = {fmt for _, fmt, _ in read}
        if len(fmts) > 1:  # gate and up in different formats: one bank needs one format
            log.warning("%s: layer %d %s mixes %s; dequantized", path.name, *bk, sorted(fmts))
            read = [(_float(t, fmt), None, key) for t, fmt, key in read]
        (fmt,) = {fmt for _, fmt, _ in read}
        tensors = [(t if fmt or dtype is None else t.to(dtype), key) for t, _, key in read]
        where = f"{path}: layer {bk[0]} bank {bk[1]}"
        yield bk, assemble(tensors, num_experts, where, bool(fmt)), fmt


def _float(t: torch.Tensor, fmt: str | None) -> torch.Tensor:
    from freetoken.kernels.reference import dequantize

    return dequantize(t, fmt).to(torch.bfloat16) if fmt else t


def read(path: Path, dtype: torch.dtype | None = None) -> ModelWeights:
    reader = _open(path)
    kv = metadata(reader)
    cls, _ = model_class(kv)
    weights = ModelWeights(config=config_of(reader, kv), source="gguf")
    dequantized = dequantized_types(reader)
    if dequantized:
        log.warning(
            "%s: dequantizing %s tensors to BF16 (no kernel reads them packed)",
            path.name,
            "/".join(dequantized),
        )
    pieces: dict[BankKey, list[tuple[object, ExpertKey]]] = defaultdict(list)
    for _, t, key in keyed_tensors(reader, cls, weights.config):
        if isinstance(key, ExpertKey):
            pieces[(key.layer, key.bank)].append((t, key))
            continue
        tensor, fmt = dense_of(cls, t, key, weights.config)
        weights.dense[key] = tensor if fmt or dtype is None else tensor.to(dtype)
        if fmt:
            weights.formats[key] = fmt
    for bk, bank, fmt in banks_of(pieces, num_experts(weights.config), path, dtype):
        weights.banks[bk] = bank
        if fmt:
            weights.formats[bk] = fmt
    return weights
