"""What the multi-head latent attention families' tests share (DeepSeek-V3, DeepSeek-V2,
GLM-4.7-Flash): their tiny reference models, the Hub spelling of their configs, and the
checks beyond tests/models/family.py (GGUF import, fixed-shape decode, show)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from freetoken import models
from freetoken.ftw.convert import convert
from freetoken.runtime import loader
from tests import fixtures
from tests.fixtures_gguf_mla import write_mla_gguf as write_gguf
from tests.models.family import PROMPT, rel
from tests.runtime.engine_util import full_logits, generate, make_engine

# the smallest shapes that keep every size distinct: heads 4, rope 16, rope-free key 16,
# value 24, latent 32 (a mix-up of any two fails on shapes)
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def yarn(mscale: float, mscale_all_dim: float, factor: float = 4.0) -> dict:
    """YaRN stretching a 64-token pretraining context, so prompts cross its ramp."""
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": factor,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def rerandomize(model: torch.nn.Module, seed: int) -> None:
    """fixtures.rerandomize, and a correction bias (a buffer in transformers) large enough to
    change which experts are chosen."""
    fixtures.rerandomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))


def build(path: Path, config_cls, model_cls, config: dict, seed: int, **kw):
    return fixtures.hf_model(
        path, config_cls, model_cls, config, seed=seed, rerandomize_params=rerandomize, **kw
    )


def hub_spelling(path: Path) -> None:
    """config.json as the Hub's checkpoints spell it: rope_scaling with `type` beside a
    top-level rope_theta, and first_k_dense_replace for mlp_layer_types."""
    p = path / "config.json"
    c = json.loads(p.read_text())
    params = dict(c.pop("rope_parameters"))
    c["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    c["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
    kinds = c.pop("mlp_layer_types", None)
    if kinds is not None:
        c["first_k_dense_replace"] = kinds.index("sparse")
    p.write_text(json.dumps(c, indent=2))


def fixed_shape_decode_matches(path: Path, hf) -> None:
    """Decode steps in fixed shapes (the CUDA graphs' form, run uncaptured) give
    transformers' tokens, sequences decoded together and at different lengths."""
    prompts = [PROMPT, PROMPT[:5], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 2]
    engine = make_engine(path, graphs="eager", page_size=4, pages=128)
    for p, s in zip(prompts, generate(engine, prompts, 12)):
        assert s.output_ids == fixtures.hf_greedy(hf, p, 12)
    assert {b for b, _ in engine.graphs._buckets} >= {3}


def gguf_matches(hf, path: Path, tmp: Path, model_type: str, **options) -> None:
    """A GGUF written by gguf's own name map converts to the same model: transformers'
    logits and tokens, from the file and from its bare form."""
    gguf = write_gguf(hf, path, tmp / "m.gguf", "F32", **options)
    out = convert(gguf, tmp / "ftw")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type
    assert config["split_kv_b"] == options.get("split_kv_b", True)
    engine = make_engine(out)
    assert rel(full_logits(engine, PROMPT), fixtures.hf_logits(hf, PROMPT)) <= 1e-4
    (seq,) = generate(engine, [PROMPT], 16)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 16)
    files = loader.with_gguf_metadata({"m.gguf": gguf}, tmp / "meta")
    assert loader.load(files, "cpu").config["model_type"] == model_type


def show_describes(path: Path, hf, tmp: Path, arch: str) -> dict:
    """show's counts are the converted tensors': transformers' weights (its correction bias
    is a buffer, ours a weight: both are in its state dict), experts at top-k for active."""
    out = convert(path, tmp / "ftw")
    index = json.loads((out / "ftw.json").read_text())
    info = models.model_info(json.loads((out / "config.json").read_text()), index)
    c = hf.config
    assert info["general.architecture"] == arch
    assert info[f"{arch}.attention.kv_lora_rank"] == c.kv_lora_rank
    assert info[f"{arch}.attention.key_length_mla"] == c.qk_nope_head_dim + c.qk_rope_head_dim
    assert info[f"{arch}.expert_count"] == c.n_routed_experts
    total = sum(t.numel() for t in hf.state_dict().values())
    assert info["general.parameter_count"] == total
    experts = sum(t.numel() for n, t in hf.state_dict().items() if ".experts." in n)
    k, e = c.num_experts_per_tok, c.n_routed_experts
    assert info["general.active_parameter_count"] == total - experts + experts * k // e
    return info


def captured_decode_matches(path: Path, hf, policy: str, slots: int) -> None:
    """On a GPU, decode steps captured as CUDA graphs (the absorbed MLA kernel inside them)
    give transformers' tokens, and the eager step's logits."""
    from tests.runtime.test_graphs import _decode_logits

    engine = make_engine(path, device="cuda", policy=policy, slots=slots, graphs="capture")
    prompts = [PROMPT, PROMPT[:5]]
    for p, s in zip(prompts, generate(engine, prompts, 24)):
        assert s.output_ids == fixtures.hf_greedy(hf, p, 24)
    assert engine.graphs.capture and engine.graphs.captures >= 1
    eager = make_engine(path, device="cuda", policy=policy, slots=slots)
    plain, captured = (_decode_logits(e, PROMPT) for e in (eager, engine))
    assert rel(captured, plain) <= 1e-5
    assert rel(full_logits(eager, PROMPT), fixtures.hf_logits(hf, PROMPT)) <= 1e-4
