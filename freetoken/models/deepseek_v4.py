"""DeepSeek-V4 (V4-Flash, V4-Pro): every layer attends through one KV head that is key and
value alike, over a sliding window and, in compressed layers, over entries that each sum a
window of tokens — all of them (heavily compressed attention, windows of 128) or those the
lightning indexer chooses (compressed sparse attention, overlapping windows of 4)
(layers/compressed_attention.py). The residual is hc_mult streams mixed around each block
by manifold-constrained hyper-connections (layers/hyper.py). Every layer's MLP is routed
experts with clamped SwiGLU beside a shared expert: the first layers pick experts by a
fixed token -> experts table, the rest by √softplus scores plus a correction bias.

Reads transformers 5's config.json (`layer_types`, `compress_rates`, nested
`rope_parameters`) and the Hub's (`compress_ratios`, `num_hash_layers`, `rope_scaling`,
`qk_rope_head_dim`), and the Hub checkpoint's tensor names (`layers.{l}.attn.wq_a`, ...,
experts `ffn.experts.{e}.w1/w2/w3`) beside transformers'. The multi-token-prediction layers
(`mtp.*`) are not read.

Shapes: T = tokens in the step, n = hc_mult streams, H = hidden, D = head_dim.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from freetoken.layers.compressed_attention import CompressedAttention
from freetoken.layers.compressor import Compressor, EntryIndexer
from freetoken.layers.hyper import HyperConnection, HyperHead
from freetoken.layers.mlp import GatedMLP
from freetoken.layers.moe import Experts, SparseMoeBlock
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope_scaling import RopeScaling, ScaledRotaryEmbedding
from freetoken.layers.routers import HashRouter, ScoredTopK
from freetoken.models import common, hub
from freetoken.models.base import ExpertKey, ExpertSpec, KVLayout
from freetoken.models.decoder import DecoderModel

MODEL_TYPE = "deepseek_v4"
GGUF_ARCH = "deepseek4"  # llama.cpp's name for the architecture

SLIDING, SPARSE, HEAVY = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
RATIOS = {SPARSE: 4, HEAVY: 128}  # the compression of each kind where a config names none


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    head_dim: int = 512
    q_lora_rank: int = 1024
    rope_dim: int = 64
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    layer_types: tuple[str, ...] = ()
    ratios: tuple[int, ...] = ()  # per layer: tokens an entry sums (0: sliding window only)
    hash_layers: tuple[int, ...] = ()  # layers routed by token id
    rope_theta: float = 10000.0  # sliding layers' rope
    compress_rope_theta: float = 160000.0  # compressed layers' and their entries' rope
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # the compressed rope's
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        n = int(cfg["num_hidden_layers"])
        rates = {**RATIOS, **(cfg.get("compress_rates") or {})}
        rates[SPARSE] = int(cfg.get("compress_rate_csa") or rates[SPARSE])
        rates[HEAVY] = int(cfg.get("compress_rate_hca") or rates[HEAVY])
        kinds = layer_types(cfg, n, rates[SPARSE])
        mlp = cfg.get("mlp_layer_types")
        if not mlp:
            n_hash = int(hub.first(cfg, "num_hash_layers", default=3))
            mlp = ["hash_moe"] * n_hash + ["moe"] * n
        head_dim = int(cfg.get("head_dim") or 512)
        main, compress = rope_settings(cfg)
        return common.args_from(
            cls,
            cfg,
            num_experts=hub.num_experts(cfg),
            head_dim=head_dim,
            rope_dim=rope_dim(cfg, head_dim),
            layer_types=kinds,
            ratios=tuple(rates.get(k, 0) for k in kinds),
            hash_layers=tuple(i for i, kind in enumerate(mlp[:n]) if kind == "hash_moe"),
            rope_theta=float(main.get("rope_theta", hub.rope_theta(cfg))),
            compress_rope_theta=float(compress["rope_theta"]),
            rope_scaling=RopeScaling.from_params(
                compress, int(cfg.get("max_position_embeddings") or 1048576)
            ),
        )


def layer_types(cfg: Mapping[str, Any], n: int, sparse: int = 4) -> tuple[str, ...]:
    """Each layer's attention: `layer_types`, else the Hub's compress_ratios (0: a sliding
    window alone, the sparse ratio: compressed sparse attention, any other: heavily
    compressed), else transformers' default (two heavily compressed layers, then
    alternating)."""
    kinds = cfg.get("layer_types")
    if not kinds and cfg.get("compress_ratios"):
        by_ratio = {0: SLIDING, sparse: SPARSE}
        kinds = [by_ratio.get(int(r), HEAVY) for r in cfg["compress_ratios"][:n]]
    if not kinds:
        kinds = [HEAVY] * min(n, 2) + [SPARSE if i % 2 else HEAVY for i in range(max(n - 2, 0))]
    if len(kinds) < n or set(kinds) - {SLIDING, SPARSE, HEAVY}:
        raise ValueError(f"layer types {kinds} do not describe {n} layers")
    return tuple(kinds[:n])


def rope_dim(cfg: Mapping[str, Any], head_dim: int) -> int:
    if cfg.get("qk_rope_head_dim"):
        return int(cfg["qk_rope_head_dim"])
    return common.rotary_dim(cfg, head_dim, default_factor=64 / 512)


def rope_settings(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sliding layers' rope settings and the compressed layers' (YaRN where the config
    scales rope, its attention factor 1: V4 leaves cos and sin unscaled)."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        return params["main"], params["compress"]
    scaling = dict(cfg.get("rope_scaling") or params)
    scaling["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    theta = float(hub.first(cfg, "compress_rope_theta", default=160000.0))
    compress = {k: v for k, v in scaling.items() if k not in ("main", "compress", "type")}
    compress["rope_theta"] = theta
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"rope_theta": hub.rope_theta(cfg)}, compress


def attention(a: ModelArgs, i: int) -> CompressedAttention:
    ratio, kind = a.ratios[i], a.layer_types[i]
    compressor = None
    if kind != SLIDING:
        rope = (a.rope_dim, a.compress_rope_theta, a.rope_scaling)
        eps = a.rms_norm_eps
        compressor = Compressor(a.hidden_size, a.head_dim, ratio, kind == SPARSE, eps, *rope)
        if kind == SPARSE:
            compressor.indexer = EntryIndexer(
                a.hidden_size,
                a.q_lora_rank,
                a.index_n_heads,
                a.index_head_dim,
                a.index_topk,
                ratio,
                eps,
                *rope,
            )
    return CompressedAttention(
        i,
        a.hidden_size,
        a.num_attention_heads,
        a.head_dim,
        q_lora_rank=a.q_lora_rank,
        o_groups=a.o_groups,
        o_lora_rank=a.o_lora_rank,
        window=a.sliding_window,
        eps=a.rms_norm_eps,
        compressor=compressor,
    )


def moe(a: ModelArgs, i: int) -> SparseMoeBlock:
    H, E, k = a.hidden_size, a.num_experts, a.num_experts_per_tok
    if i in a.hash_layers:
        router = HashRouter(H, E, k, a.vocab_size, a.scoring_func, a.routed_scaling_factor)
    else:
        router = ScoredTopK(H, E, k, a.scoring_func, a.routed_scaling_factor)
    spec = ExpertSpec(H, a.moe_intermediate_size, activation="silu_clamped", limit=a.swiglu_limit)
    # one shared expert of the routed ones' width, as transformers builds it (whatever
    # n_shared_experts says)
    shared = GatedMLP(H, a.moe_intermediate_size, limit=a.swiglu_limit)
    return SparseMoeBlock(router, Experts(i, E, spec), shared)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        self.self_attn = attention(a, i)
        self.mlp = moe(a, i)
        H, eps = a.hidden_size, a.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        hc = (H, a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.rope = "main" if a.layer_types[i] == SLIDING else "compress"

    def forward(self, h: torch.Tensor, rope: dict, token_ids: torch.Tensor) -> torch.Tensor:
        """h [T, n, H]: the streams after this layer."""
        post, comb, x = self.attn_hc(h)
        h = self.attn_hc.merge(
            h, self.self_attn(self.input_layernorm(x), rope[self.rope]), post, comb
        )
        post, comb, x = self.ffn_hc(h)
        out = self.mlp(self.post_attention_layernorm(x), token_ids)
        return self.ffn_hc.merge(h, out, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n = a.hc_mult
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.hc_head = HyperHead(a.hidden_size, a.hc_mult, a.hc_eps, a.rms_norm_eps)
        self.rotary = ScaledRotaryEmbedding(a.rope_dim, a.rope_theta, pairs=True)
        self.compress_rotary = ScaledRotaryEmbedding(
            a.rope_dim, a.compress_rope_theta, a.rope_scaling, pairs=True
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = {
            "main": self.rotary(positions, x.dtype),
            "compress": self.compress_rotary(positions, x.dtype),
        }
        h = x[:, None].expand(-1, self.n, -1).contiguous()  # [T, n, H]
        for layer in self.layers:
            h = layer(h, rope, input_ids)
        return self.norm(self.hc_head(h))


# the Hub checkpoint's names -> the model's, in order (facts of the checkpoint's layout)
_HUB_NAMES = (
    (r"^(embed|head|norm|hc_head_\w+)\b", r"model.\1"),
    (r"^layers\.", "model.layers."),
    (r"^model\.embed\.", "model.embed_tokens."),
    (r"^model\.head\.", "lm_head."),
    (r"^model\.hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)
_EXPERT = re.compile(
    r"(?:model\.)?layers\.(\d+)\.(?:mlp|ffn)\.experts\."
    r"(?:(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))"
)
_HALF = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


class Model(DecoderModel):
    # what transformers keeps in fp32 in a bf16 model: the hyper-connections, sinks, window
    # biases, correction biases and every norm's weight
    FP32 = (
        "attn_hc",
        "ffn_hc",
        "hc_head",
        "sinks",
        "position_bias",
        "e_score_correction_bias",
        "q_a_norm",
        "kv_norm",
        "input_layernorm",
        "post_attention_layernorm",
        "norm",
    )

    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        super().__init__(args, DeepseekV4Model(args))

    def layer_kv(self, i: int) -> KVLayout:
        a, attn = self.args, self.model.layers[i].self_attn
        if attn.compressor is None:
            return KVLayout("latent", 1, a.head_dim, window=a.sliding_window)
        inputs = attn.compressor.inputs_dim
        index = attn.indexer
        if index is not None:
            inputs += index.inputs_dim
        index_dim = a.index_head_dim if index is not None else 0
        return KVLayout.compressed(a.head_dim, a.sliding_window, a.ratios[i], inputs, index_dim)

    dense_key = staticmethod(common.renamer(*_HUB_NAMES))

    @staticmethod
    def expert_key(name: str) -> ExpertKey | None:
        """Per-expert tensors (the Hub's w1/w2/w3, or gate/up/down_proj) and transformers'
        fused gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
        m = _EXPERT.fullmatch(name)
        if not m:
            return None
        layer = int(m.group(1))
        if m.group(4):
            return ExpertKey(layer, "gate_up" if m.group(4) == "gate_up_proj" else "down")
        half = _HALF.get(m.group(3))
        return ExpertKey(layer, "down" if half is None else "gate_up", int(m.group(2)), half)

    @classmethod
    def ignored(cls, name: str, config: Mapping[str, Any]) -> bool:
        """The multi-token-prediction layers: the Hub's `mtp.*`, or layers past the last."""
        return name.startswith("mtp.") or super().ignored(name, config)

    @staticmethod
    def gguf_key(name: str) -> str | ExpertKey:
        raise ValueError("GGUF files of DeepSeek-V4 are not read yet: convert from safetensors")

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        raise ValueError(f"GGUF files of {arch} are not read yet: convert from safetensors")

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a, g = ModelArgs.from_dict(config), GGUF_ARCH
        info = hub.standard_info(g, config)
        return info | {
            f"{g}.attention.head_count_kv": 1,
            f"{g}.attention.key_length": a.head_dim,
            f"{g}.attention.q_lora_rank": a.q_lora_rank,
            f"{g}.attention.output_lora_rank": a.o_lora_rank,
            f"{g}.attention.output_group_count": a.o_groups,
            f"{g}.attention.sliding_window": a.sliding_window,
            f"{g}.attention.compress_ratios": list(a.ratios),
            f"{g}.attention.indexer.head_count": a.index_n_heads,
            f"{g}.attention.indexer.key_length": a.index_head_dim,
            f"{g}.attention.indexer.top_k": a.index_topk,
            f"{g}.rope.dimension_count": a.rope_dim,
            f"{g}.expert_shared_count": a.n_shared_experts,
            f"{g}.expert_weights_scale": a.routed_scaling_factor,
            f"{g}.hash_layer_count": len(a.hash_layers),
            f"{g}.hyper_connection_count": a.hc_mult,
        }
