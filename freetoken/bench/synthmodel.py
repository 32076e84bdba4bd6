"""Benchmark models built in memory: Qwen3-MoE shapes with seeded random weights.

Weights are generated on the GPU (fast) as randn·0.02 in the model dtype; dense weights stay
there, expert banks are copied to host memory. Nothing touches the disk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from freetoken.ftw.hostmem import HostBuffer
from freetoken.models.qwen3_moe import Model

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)

SHAPES = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-30b-a3b-half": {**QWEN3_30B_A3B, "num_hidden_layers": 24},
    "tiny": {
        **QWEN3_30B_A3B,
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
    },
}


@dataclass
class SynthModel:
    model: Model
    config: dict
    banks: dict  # (layer, bank) -> host tensor
    device: torch.device
    dtype: torch.dtype
    seconds: float


def build(
    name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> SynthModel:
    t0 = time.perf_counter()
    config = dict(SHAPES[name])
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    g = torch.Generator(device=gen_device).manual_seed(seed)
    with torch.device("meta"):
        model = Model.from_config(config)
    model.to_empty(device=device)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.data = torch.ones(p.shape, dtype=dtype, device=device)
            else:
                p.data = (
                    torch.randn(p.shape, generator=g, device=gen_device, dtype=torch.float32) * 0.02
                ).to(device=device, dtype=dtype)
    for m in model.modules():
        reset = getattr(m, "reset_buffers", None)
        if callable(reset):
            reset()
    banks = _expert_banks(config, dtype, g, gen_device)
    model.eval()
    return SynthModel(model, config, banks, device, dtype, time.perf_counter() - t0)


def _expert_banks(
    config: dict, dtype: torch.dtype, g: torch.Generator, gen_device: torch.device
) -> dict:
    """Seeded random banks in fresh host mappings. From a GPU they go through one pinned
    staging buffer and then a multi-threaded host copy: a GPU copy straight into unpinned,
    never-touched pages faulted them in from one thread at ~1 GB/s (a minute for 54 GiB)."""
    E, H, I = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    shapes = (("gate_up", (E, 2 * I, H)), ("down", (E, H, I)))
    staging = None
    if gen_device.type == "cuda":
        staging = torch.empty(
            max(E * a * b for _, (_, a, b) in shapes), dtype=dtype, pin_memory=True
        )
    banks = {}
    for layer in range(config["num_hidden_layers"]):
        for bank, shape in shapes:
            n = E * shape[1] * shape[2]
            buf = HostBuffer(n * torch.tensor([], dtype=dtype).element_size())
            host = buf.tensor(str(dtype).removeprefix("torch."), list(shape), buf.nbytes)
            w = (
                torch.randn(shape, generator=g, device=gen_device, dtype=torch.float32)
                .mul_(0.02)
                .to(dtype)
            )
            if staging is not None:
                w = staging[:n].view(shape).copy_(w)
            host.copy_(w)
            banks[(layer, bank)] = host
    return banks
