"""Quantized weights: the block formats, declared once for every reader, writer and kernel.

A packed tensor is a uint8 tensor whose last dimension holds each row's blocks back to back:
logical shape (..., cols) is stored as (..., cols / block · block_bytes). Every other
dimension keeps its meaning, so an expert bank [E, rows, cols] packs to
[E, rows, row_bytes]: an expert, a row, a rank's share of experts or a GPU slot is a plain
byte range, and rows can be split, concatenated, interleaved or copied without decoding.
Only the last dimension cannot be transposed: checkpoints store quantized matrices as
[out, in], the layout the kernels read.

Torch-free: the server names formats (`create --quantize`, `show`) without the engine.
Decoding lives in kernels/reference.py (the definition) and the kernels; quantizing in
quant/quantize.py; checkpoints' own layouts are turned into these in quant/pack.py.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CHECKPOINT_METHODS",
    "FORMATS",
    "GGML_TYPES",
    "QUANTIZE_TYPES",
    "QuantError",
    "QuantFormat",
    "get",
    "quantize_type",
]


class QuantError(ValueError):
    """A quantized tensor whose type, size or scales do not add up."""


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """One block format: `block` weights of a row in `block_bytes` bytes, scales inside.

    name: the format's name in FTW (`quant`) and in the kernels' specs.
    code: the number the C++ and Triton kernels take for it.
    ggml_type: GGUF's tensor type for the same bytes (None: no GGUF type).
    layout: the block's bytes, first to last (the normative description, docs/ftw.md).
    """

    name: str
    code: int
    block: int
    block_bytes: int
    ggml_type: int | None
    layout: str

    def row_bytes(self, cols: int) -> int:
        if cols % self.block:
            raise QuantError(f"{self.name} rows hold multiples of {self.block} weights, not {cols}")
        return cols // self.block * self.block_bytes

    def packed_shape(self, shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The uint8 shape that holds a tensor of logical `shape`."""
        *outer, cols = shape
        return (*outer, self.row_bytes(cols))

    def logical_cols(self, row_bytes: int) -> int:
        if row_bytes % self.block_bytes:
            raise QuantError(f"{row_bytes} bytes are not whole {self.name} blocks")
        return row_bytes // self.block_bytes * self.block

    @property
    def bits(self) -> float:
        """Bits per weight, scales included."""
        return self.block_bytes * 8 / self.block


_K_SCALES = (
    "12 bytes of 6-bit sub-block scales and mins: bytes 0-3 hold scales 0-3, bytes 4-7 mins "
    "0-3 (low 6 bits each; their top 2 bits are the top bits of scale/min 4-7), bytes 8-11 the "
    "low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)"
)

FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("q8_0", 1, 32, 34, 8, "fp16 d, 32 int8 q; w = d·q"),
        QuantFormat(
            "q4_0",
            2,
            32,
            18,
            2,
            "fp16 d, 16 bytes: weight j < 16 in the low nibble of byte j, weight j + 16 in its "
            "high nibble; w = d·(q − 8)",
        ),
        QuantFormat(
            "q4_k",
            3,
            256,
            144,
            12,
            f"fp16 d, fp16 dmin, {_K_SCALES}, 128 bytes of 4-bit q: 32 bytes per 64 weights, "
            "the first 32 in low nibbles; w = d·sc[s]·q − dmin·m[s] over 8 sub-blocks s of 32",
        ),
        QuantFormat(
            "q5_k",
            4,
            256,
            176,
            13,
            f"fp16 d, fp16 dmin, {_K_SCALES}, 32 bytes qh (bit s of byte l: the fifth bit of "
            "weight 32s + l), 128 bytes of low nibbles as q4_k; w = d·sc[s]·q − dmin·m[s]",
        ),
        QuantFormat(
            "q6_k",
            5,
            256,
            210,
            14,
            "128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d; per half h of 128 weights: "
            "weight 128h + i has low 4 bits in ql[64h + i mod 64] (high nibble when i ≥ 64) and "
            "high 2 bits at bit 2·(i div 32) of qh[32h + i mod 32]; w = d·scale[j div 16]·(q − 32)",
        ),
        QuantFormat(
            "mxfp4",
            6,
            32,
            17,
            39,
            "e8m0 exponent e, 16 bytes of e2m1 codes in q4_0's nibble order; w = e2m1(q)·2^(e−127)",
        ),
        QuantFormat(
            "fp8_e4m3",
            7,
            128,
            132,
            None,
            "fp32 scale, 128 e4m3 weights; w = e4m3·scale. A checkpoint's 128×128 block scale "
            "(weight_scale_inv) is repeated in each of its 128 rows, so rows stand alone",
        ),
        QuantFormat(
            "nvfp4",
            8,
            128,
            76,
            None,
            "fp32 tensor scale s2 (the checkpoint's weight_scale_2, repeated in every block so "
            "rows stand alone), 8 e4m3 scales sc[g] (one per 16 weights), 64 bytes of e2m1 "
            "codes: weight 2i in the low nibble of byte i, 2i + 1 in its high nibble; "
            "w = e2m1(q)·(sc[i div 16]·s2)",
        ),
    )
}

# GGUF tensor types kept packed on import, by GGUF type number
GGML_TYPES: dict[int, QuantFormat] = {
    f.ggml_type: f for f in FORMATS.values() if f.ggml_type is not None
}

# Hugging Face checkpoints' quantization (quantization_config.quant_method) whose blocks are
# kept, and the format each is repacked to (quant/pack.py)
# (ModelOpt's "modelopt" only with quant_algo NVFP4: weights/safetensors_dir.py checks it)
CHECKPOINT_METHODS = {"fp8": "fp8_e4m3", "mxfp4": "mxfp4", "modelopt": "nvfp4"}

# what `create --quantize` accepts (lowercase), and what each means for expert banks
QUANTIZE_TYPES = ("q4_K_M", "q8_0")


def quantize_type(name: str) -> str:
    """A `create --quantize` type in its canonical spelling (q4_K_M, q8_0), whatever the
    case it was given in; an unknown one is an error naming those known."""
    for known in QUANTIZE_TYPES:
        if name.lower() == known.lower():
            return known
    raise QuantError(
        f"unsupported quantization type {name!r} (supported: {', '.join(QUANTIZE_TYPES)})"
    )


def get(name: str) -> QuantFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise QuantError(
            f"unknown quantized format {name!r} (known: {', '.join(FORMATS)})"
        ) from None
