"""What DeepSeek-V4's tests share: its tiny reference model (weights re-randomised so routing
is decisive, and a token -> experts table of distinct experts), the Hub's spelling of its
config and checkpoint names, and show's counts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from freetoken import models
from freetoken.ftw.convert import convert
from freetoken.models.deepseek_v4 import HEAVY, SLIDING, SPARSE
from tests import fixtures
from tests.models import mla

__all__ = ["HEAVY", "SLIDING", "SPARSE", "build", "hub_spelling", "show_describes"]


def rerandomize(model: torch.nn.Module, seed: int) -> None:
    """mla.rerandomize (the correction biases), and every hash layer's table: k distinct
    experts per token."""
    mla.rerandomize(model, seed)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                V, k = buf.shape
                E = model.config.n_routed_experts
                buf.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)]))


def build(path: Path, config: dict, seed: int, **kw):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    return fixtures.hf_model(
        path,
        DeepseekV4Config,
        DeepseekV4ForCausalLM,
        config,
        seed=seed,
        rerandomize_params=rerandomize,
        **kw,
    )


# transformers' names -> the Hub checkpoint's, in order (the model file maps them back)
_TO_HUB = (
    ("model.embed_tokens.", "embed."),
    ("lm_head.", "head."),
    ("model.hc_head.hc_", "hc_head_"),
    ("model.", ""),
    (".self_attn.compressor.indexer.scorer.weights_proj.", ".attn.indexer.weights_proj."),
    (".self_attn.compressor.indexer.q_b_proj.", ".attn.indexer.wq_b."),
    (".self_attn.compressor.indexer.", ".attn.indexer.compressor."),
    (".self_attn.", ".attn."),
    (".mlp.", ".ffn."),
    (".input_layernorm.", ".attn_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
    (".attn_hc.", ".hc_attn_"),
    (".ffn_hc.", ".hc_ffn_"),
    (".sinks", ".attn_sink"),
    ("compressor.kv_norm.", "compressor.norm."),
    (".position_bias", ".ape"),
    (".q_a_proj.", ".wq_a."),
    (".q_b_proj.", ".wq_b."),
    (".kv_proj.", ".wkv."),
    ("shared_experts.gate_proj.", "shared_experts.w1."),
    ("shared_experts.down_proj.", "shared_experts.w2."),
    ("shared_experts.up_proj.", "shared_experts.w3."),
    (".gate_proj.", ".wgate."),
    (".o_a_proj.", ".wo_a."),
    (".o_b_proj.", ".wo_b."),
    (".q_a_norm.", ".q_norm."),
    (".gate.e_score_correction_bias", ".gate.bias"),
)


def _hub_name(name: str) -> str:
    for ours, theirs in _TO_HUB:
        name = name.replace(ours, theirs)
    return name


def hub_spelling(path: Path, hf) -> None:
    """The directory as the Hub's checkpoint is: compress_ratios, num_hash_layers and
    qk_rope_head_dim in config.json; DeepSeek's tensor names (layers.{l}.attn.wq_a, ...,
    experts ffn.experts.{e}.w1/w2/w3); a multi-token-prediction layer to skip."""
    p = path / "config.json"
    c = json.loads(p.read_text())
    rates = c.pop("compress_rates")
    c["compress_ratios"] = [0 if k == SLIDING else rates[k] for k in c.pop("layer_types")]
    c["compress_rate_hca"] = rates[HEAVY]
    c["num_hash_layers"] = c.pop("mlp_layer_types").count("hash_moe")
    c["qk_rope_head_dim"] = int(c["head_dim"] * c.pop("partial_rotary_factor"))
    c["rope_theta"] = c["rope_parameters"]["main"]["rope_theta"]
    c["compress_rope_theta"] = c.pop("rope_parameters")["compress"]["rope_theta"]
    p.write_text(json.dumps(c, indent=2))
    tensors = {"mtp.0.hc_head_fn": torch.zeros(2)}
    for name, t in hf.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix = _hub_name(name.removesuffix("gate_up_proj"))
            for e, w in enumerate(t):
                tensors[f"{prefix}{e}.w1.weight"], tensors[f"{prefix}{e}.w3.weight"] = w.chunk(2)
        elif name.endswith("experts.down_proj"):
            prefix = _hub_name(name.removesuffix("down_proj"))
            tensors |= {f"{prefix}{e}.w2.weight": w for e, w in enumerate(t)}
        elif "rotary_emb" not in name:
            tensors[_hub_name(name)] = t
    for old in path.glob("*.safetensors*"):
        old.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def show_describes(path: Path, hf, tmp: Path) -> dict:
    """show's counts are the converted tensors': every tensor transformers saves (the hash
    tables and correction biases among them), experts at top-k for active."""
    out = convert(path, tmp / "ftw")
    index = json.loads((out / "ftw.json").read_text())
    info = models.model_info(json.loads((out / "config.json").read_text()), index)
    c = hf.config
    assert info["general.architecture"] == "deepseek4"
    assert info["deepseek4.expert_count"] == c.n_routed_experts
    total = sum(t.numel() for t in hf.state_dict().values())
    assert info["general.parameter_count"] == total
    experts = sum(t.numel() for n, t in hf.state_dict().items() if ".experts." in n)
    k, e = c.num_experts_per_tok, c.n_routed_experts
    assert info["general.active_parameter_count"] == total - experts + experts * k // e
    return info
