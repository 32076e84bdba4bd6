"""Quantized Hugging Face checkpoints written from a transformers model: FP8 with 128×128
block scales (as DeepSeek-V3 and Qwen3's FP8 releases store them), gpt-oss's MXFP4 and
NVIDIA ModelOpt's NVFP4, each with the float weights they decode to, for the reference
model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # the largest e4m3 value


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] as e4m3 weights and the fp32 multiplier of each 128×128 block."""
    R, C = w.shape
    br, bc = -(-R // 128), C // 128
    padded = torch.zeros(br * 128, C)
    padded[:R] = w
    blocks = padded.reshape(br, 128, bc, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[:, None, :, None]).reshape(br * 128, C)[:R].to(torch.float8_e4m3fn)
    return q, scale


def _copy_but_weights(src: Path, out: Path, quantization: dict) -> dict[str, torch.Tensor]:
    """The HF directory `src` copied into `out` but for its weights, its config declaring
    `quantization`; returns `src`'s tensors by name, for the caller to write."""
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return load_file(src / "model.safetensors")


def _stays_float(name: str, t: torch.Tensor) -> bool:
    """Embeddings, the output head, routers and rows not whole 128-weight blocks stay float,
    as in released checkpoints."""
    keep = "embed" in name or "lm_head" in name or name.endswith("mlp.gate.weight")
    return t.dim() != 2 or t.shape[1] % 128 != 0 or keep


def write_fp8(src: Path, out: Path, drop_scale: str | None = None) -> dict[str, torch.Tensor]:
    """A copy of the HF directory `src` with every 2-D weight whose rows are whole 128-weight
    blocks in FP8 (embeddings, the output head and routers stay as they are, as in released
    checkpoints); returns the float weights the FP8 ones decode to, by name. `drop_scale`
    leaves that tensor's scale out (a broken checkpoint)."""
    quantization = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    decoded, tensors = {}, {}
    for name, t in _copy_but_weights(src, out, quantization).items():
        if _stays_float(name, t):
            tensors[name] = t
            continue
        q, scale = fp8_blocks(t.float())
        tensors[name] = q
        if name != drop_scale:
            tensors[name + "_scale_inv"] = scale
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0]]
        decoded[name] = q.float() * full
    save_file(tensors, out / "model.safetensors")
    return decoded


def mxfp4_hf(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., C] as gpt-oss's `*_blocks` [..., C/32, 16] and `*_scales` [..., C/32]: gguf's
    MXFP4 quantizer, its bytes rearranged to weight 2b in the low nibble of byte b."""
    import gguf

    q = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
    q = q.reshape(*w.shape[:-1], w.shape[-1] // 32, 17)
    scales, packed = q[..., 0], q[..., 1:]
    codes = np.concatenate([packed & 15, packed >> 4], axis=-1)  # weights 0..31 in order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(scales)


def write_nvfp4(src: Path, out: Path) -> dict[str, torch.Tensor]:
    """write_fp8's copy in ModelOpt's NVFP4 layout: `weight` uint8 [R, C/2] (column 2i in the
    low nibble of byte i), `weight_scale` e4m3 [R, C/16], fp32 `weight_scale_2` and an
    `input_scale` (unused); returns the float weights they decode to, by name."""
    from freetoken.kernels import reference
    from freetoken.quant.quantize import quantize

    quantization = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    decoded, tensors = {}, {}
    for name, t in _copy_but_weights(src, out, quantization).items():
        if _stays_float(name, t):
            tensors[name] = t
            continue
        R, C = t.shape
        packed = quantize(t.float(), "nvfp4")
        blocks = packed.reshape(R, C // 128, 76)
        module = name.removesuffix(".weight")
        tensors[name] = blocks[..., 12:].reshape(R, C // 2).contiguous()
        scales = blocks[..., 4:12].reshape(R, C // 16).contiguous()
        tensors[module + ".weight_scale"] = scales.view(torch.float8_e4m3fn)
        tensors[module + ".weight_scale_2"] = blocks[0, 0, :4].clone().view(torch.float32)[0]
        tensors[module + ".input_scale"] = torch.tensor(1.0)
        decoded[name] = reference.dequantize(packed, "nvfp4")
    save_file(tensors, out / "model.safetensors")
    return decoded
