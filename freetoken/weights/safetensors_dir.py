"""A Hugging Face checkpoint directory (config.json + *.safetensors) as ModelWeights.

This is the slow path: expert pieces scattered over the checkpoint are gathered into
[E, ...] banks at load time, one (layer, bank) at a time. FTW stores the banks ready-made;
the converter walks the same `Checkpoint` to write them. FP8 (e4m3, 128×128 block scales),
MXFP4 and ModelOpt NVFP4 checkpoints stay quantized: their weights come out packed
(freetoken/quant).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from freetoken import quant
from freetoken.models import hub
from freetoken.models.base import ExpertKey
from freetoken.models.hub import num_experts
from freetoken.quant import QuantError, pack
from freetoken.weights import BankKey, ModelWeights, WeightsError, bank_reads
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


# bits per element of safetensors' dtype names (F4: e2m1, two a byte)
_ITEM_BITS = {"F64": 64, "I64": 64, "F32": 32, "I32": 32, "F16": 16, "BF16": 16, "I16": 16}
_ITEM_BITS |= {"U8": 8, "I8": 8, "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4}


def _scaled(dtype: str) -> bool:
    """An 8- or 4-bit float dtype: such a weight cannot be read without its scale."""
    return dtype.startswith(("F8_", "F4"))


# quantized checkpoints whose blocks the kernels read as they are (freetoken/quant/pack.py)
KEPT_METHODS = tuple(quant.CHECKPOINT_METHODS)
FP8_SCALE = ".weight_scale_inv"  # beside "<module>.weight": one fp32 per 128×128 block
# DeepSeek-V4's own names: "<module>.scale" beside "<module>.weight", e8m0 powers of two (one
# per 128×128 block of an FP8 weight, one per 32 weights of a routed expert's FP4 one)
V4_SCALE = ".scale"
MXFP4_PARTS = ("_blocks", "_scales")  # "<name>_blocks" (codes) beside "<name>_scales"
# ModelOpt NVFP4: "<module>.weight" (codes) beside its group scales and its tensor scale
NVFP4_SCALES = (".weight_scale", ".weight_scale_2")
# ModelOpt's static scales of activations and of an FP8 KV cache: unused, both stay float here
MODELOPT_UNUSED = (".input_scale", ".k_scale", ".v_scale")


def quant_method(config: dict) -> str | None:
    """The checkpoint's quantization (quantization_config), if it is one the kernels keep;
    others are refused before a tensor is read, rather than failing on their tensor names."""
    q = config.get("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    if not method:
        return None
    if method not in KEPT_METHODS:
        raise WeightsError(
            f"the checkpoint's weights are {method}-quantized (quantization_config), which is "
            f"not supported (FP8, MXFP4 and ModelOpt NVFP4 are): use its BF16 form"
        )
    if method == "modelopt" and q.get("quant_algo") != "NVFP4":
        raise WeightsError(
            f"ModelOpt {q.get('quant_algo')} checkpoints are not supported (NVFP4 is): "
            "use its BF16 form"
        )
    block = q.get("weight_block_size")
    if method == "fp8" and block is not None and list(block) != [128, 128]:
        raise WeightsError(f"FP8 blocks of {block} are not supported (128×128 are)")
    return method


class Checkpoint:
    """Open safetensors files, with tensor names sorted into dense weights and expert pieces.

    `model_cls` is the model file's `Model` (models/base.py, ModelFile): its `expert_key`
    says which tensors are expert pieces, `dense_key` what the model calls the others and
    `ignored` which it does not use. A quantized checkpoint's scale tensors are never shown
    to the model: each is read with the weight it scales, which comes out packed.
    """

    def __init__(self, files: dict[str, Path], model_cls: type, dtype: torch.dtype | None = None):
        self.config = hub.read_config(files)
        self.method = quant_method(self.config)
        self.experts = num_experts(self.config)
        self.dtype = dtype
        self.dense_key = model_cls.dense_key
        self._stack = ExitStack()
        self.handles: dict[str, object] = {}
        self.scales: dict[str, str] = {}  # a packed weight's name -> its scale tensor's
        self.hidden: set[str] = set()  # other tensors read with a weight, or not at all
        self.dense: list[str] = []
        self.pieces: dict[BankKey, list[tuple[str, ExpertKey]]] = defaultdict(list)
        self.paths: list[Path] = safetensors_files(files)
        self._stored: dict[str, bank_reads.Stored] | None = None  # read when first needed
        for path in self.paths:
            f = self._stack.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():
                if not model_cls.ignored(name, self.config):
                    self.handles[name] = f
        self._pair_scales()
        for name in self.handles:
            if name in self.scales.values() or name in self.hidden:
                continue
            key = model_cls.expert_key(name)
            if key is None:
                self.dense.append(name)
            else:
                self.pieces[(key.layer, key.bank)].append((name, key))

    def _pair_scales(self) -> None:
        """Each quantized weight with its scale tensor; one without is an error naming it."""
        needs = []
        for name, f in self.handles.items():
            if self.method == "modelopt":
                if name.endswith(NVFP4_SCALES[0]):
                    weight = name.removesuffix(NVFP4_SCALES[0]) + ".weight"
                    self.scales[weight] = name
                    needs.append((weight, name.removesuffix(NVFP4_SCALES[0]) + NVFP4_SCALES[1]))
                elif name.endswith((NVFP4_SCALES[1], *MODELOPT_UNUSED)):
                    self.hidden.add(name)
            elif self.method == "fp8" and name.endswith(FP8_SCALE):
                self.scales[name.removesuffix(FP8_SCALE) + ".weight"] = name
            elif self.method == "fp8" and name.endswith(V4_SCALE):
                weight = name.removesuffix(V4_SCALE) + ".weight"
                if weight in self.handles:
                    self.scales[weight] = name
            elif self.method == "mxfp4" and name.endswith(MXFP4_PARTS[0]):
                self.scales[name] = name.removesuffix(MXFP4_PARTS[0]) + MXFP4_PARTS[1]
            elif name not in self.scales and _scaled(dt := f.get_slice(name).get_dtype()):
                if name.endswith(NVFP4_SCALES[0]) and self.method is None:
                    raise WeightsError(
                        f"tensor {name} holds NVFP4 group scales, but the checkpoint declares no "
                        f"quantization (config.json's quantization_config or {hub.QUANT_FILE})"
                    )
                partner = V4_SCALE if dt == "F4" else FP8_SCALE  # what it cannot be read without
                self.scales[name] = name.removesuffix(".weight") + partner
        for weight, scale in [*self.scales.items(), *needs]:
            for needed in (weight, scale):
                if needed not in self.handles:
                    raise WeightsError(
                        f"tensor {needed} is missing: {weight} is quantized and needs {scale}"
                    )

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tensor(self, name: str) -> tuple[torch.Tensor, str | None]:
        """A tensor and its block format: packed (freetoken/quant) for a quantized weight."""
        if name in self.scales:
            return self._packed(name)
        t = self.handles[name].get_tensor(name)
        return (t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t), None

    def _packed(self, name: str) -> tuple[torch.Tensor, str]:
        scale = self.handles[self.scales[name]].get_tensor(self.scales[name])
        w = self.handles[name].get_tensor(name)
        try:
            if self.method == "mxfp4":
                return pack.mxfp4_from_hf(w, scale), "mxfp4"
            if self.method == "modelopt":
                s2 = name.removesuffix(".weight") + NVFP4_SCALES[1]
                s2 = self.handles[s2].get_tensor(s2)
                return pack.nvfp4_from_modelopt(w, scale, s2), "nvfp4"
            if w.dtype == torch.float4_e2m1fn_x2:  # DeepSeek-V4's routed experts
                return pack.mxfp4_rows(w, scale), "mxfp4"
            if w.dtype != torch.float8_e4m3fn:
                raise QuantError(
                    f"{w.dtype} weights beside block scales (e4m3, or e2m1 for FP4 experts, "
                    "expected)"
                )
            return pack.fp8_rows(w, scale), "fp8_e4m3"
        except QuantError as e:
            raise WeightsError(f"tensor {name}: {e}") from None

    def nbytes(self) -> int:
        """Bytes of the tensors the model reads (those it ignores not counted), as stored."""
        total = 0
        for name, f in self.handles.items():
            piece = f.get_slice(name)
            n = 1
            for d in piece.get_shape():
                n *= d
            total += n * _ITEM_BITS[piece.get_dtype()]
        return total // 8

    def bank_keys(self) -> list[BankKey]:
        return sorted(self.pieces)

    def bank(self, key: BankKey) -> tuple[torch.Tensor, str | None]:
        """The [E, ...] bank assembled from its per-expert (or already fused) pieces, and its
        block format."""
        where = f"experts of layer {key[0]} bank {key[1]}"
        if self.method is None:  # unquantized pieces may be read into place
            bank = bank_reads.read_bank(self._stored_pieces(key), self.experts, self.dtype)
            if bank is not None:
                return bank, None
        read = [(*self.tensor(name), k) for name, k in self.pieces[key]]
        fmts = {fmt for _, fmt, _ in read}
        if len(fmts) != 1:
            raise WeightsError(f"{where}: pieces in different formats {sorted(map(str, fmts))}")
        fmt = fmts.pop()
        return assemble([(t, k) for t, _, k in read], self.experts, where, bool(fmt)), fmt

    def _stored_pieces(self, key: BankKey) -> list[tuple[bank_reads.Stored, ExpertKey]]:
        if self._stored is None:
            self._stored = {}
            for path in self.paths:
                self._stored |= bank_reads.header(path)
        return [(self._stored[name], k) for name, k in self.pieces[key]]

    def dense_items(self) -> Iterator[tuple[str, torch.Tensor, str | None]]:
        """Dense tensors under the model's own names, with their block formats."""
        for name in self.dense:
            yield self.dense_key(name), *self.tensor(name)


def read(files: dict[str, Path], model_cls: type, dtype: torch.dtype | None = None) -> ModelWeights:
    with Checkpoint(files, model_cls, dtype) as ck:
        weights = ModelWeights(config=ck.config, source="safetensors")
        for name, t, fmt in ck.dense_items():
            weights.dense[name] = t
            if fmt:
                weights.formats[name] = fmt
        for key in ck.bank_keys():
            weights.banks[key], fmt = ck.bank(key)
            if fmt:
                weights.formats[key] = fmt
    return weights
