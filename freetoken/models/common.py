"""What model files share beyond models/decoder.py: config dicts read into a family's args,
checkpoint tensor names (per-expert Hub tensors and transformers 5's fused banks), and
llama.cpp's GGUF tensor names and metadata.

Nothing here names a family: each model file passes its own spellings in.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from freetoken.models import hub
from freetoken.models.base import ExpertKey

__all__ = [
    "GGUF_LAYER",
    "ExpertNames",
    "GgufNames",
    "args_from",
    "gguf_base_config",
    "gguf_sigmoid_routing",
    "require_sigmoid_gating",
    "sigmoid_routing_info",
    "renamer",
    "require_default_rope",
    "rotary_dim",
]


def args_from(cls: type, cfg: Mapping[str, Any], **computed: Any) -> Any:
    """A frozen args dataclass from the config keys it names (None and absent keys take the
    field defaults, lists become tuples), `computed` overriding."""
    names = {f.name for f in fields(cls)}
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in names}
    kw = {k: v for k, v in kw.items() if v is not None}
    return cls(**{**kw, **computed})


def require_default_rope(cfg: Mapping[str, Any]) -> None:
    """Refuses rope scaling (YaRN, linear, ...) rather than computing plain rope instead."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise ValueError(f"rope scaling {kind!r} is not supported for {cfg.get('model_type')}")


def rotary_dim(cfg: Mapping[str, Any], head_dim: int, default_factor: float = 1.0) -> int:
    """The rotated width of each head: `rotary_dim` where the config spells it so, else
    head_dim × `partial_rotary_factor` (top level, or in transformers 5's rope_parameters)."""
    if cfg.get("rotary_dim"):
        return int(cfg["rotary_dim"])
    params = cfg.get("rope_parameters") or {}
    factor = hub.first(cfg, "partial_rotary_factor", default=None)
    if factor is None:
        factor = params.get("partial_rotary_factor", default_factor)
    return int(head_dim * float(factor))


# where a multimodal checkpoint keeps its language model's tensors
LANGUAGE_MODEL = r"^model\.language_model\."
_LANGUAGE_MODEL = re.compile(LANGUAGE_MODEL)


def language_model(name: str) -> str:
    """A multimodal checkpoint's language-model tensor under the text model's name."""
    return _LANGUAGE_MODEL.sub("model.", name)


def renamer(*pairs: tuple[str, str]) -> Callable[[str], str]:
    """A `dense_key`: checkpoint names to the model's, by regex substitutions in order."""
    compiled = [(re.compile(p), r) for p, r in pairs]

    def dense_key(name: str) -> str:
        for pattern, replacement in compiled:
            name = pattern.sub(replacement, name)
        return name

    return dense_key


class ExpertNames:
    """An `expert_key`: where a family's expert tensors sit in its checkpoints.

    Per expert (the Hub's): `model.layers.{l}.{block}.experts.{e}.{gate|up|down}.weight`
    with the family's block and projection names; fused (transformers 5 with
    save_original_format=False): `model.layers.{l}.mlp.experts.gate_up_proj` [E, 2I, H] and
    `.down_proj` [E, H, I].
    """

    def __init__(
        self,
        block: str = "mlp",
        gate: str = "gate_proj",
        up: str = "up_proj",
        down: str = "down_proj",
    ):
        self.halves = {gate: 0, up: 1, down: None}
        parts = "|".join(re.escape(p) for p in self.halves)
        self.pattern = re.compile(
            rf"model\.layers\.(\d+)\.(?:{re.escape(block)}|mlp)\.experts\."
            rf"(?:(\d+)\.({parts})\.weight|(gate_up_proj|down_proj))"
        )

    def __call__(self, name: str) -> ExpertKey | None:
        m = self.pattern.fullmatch(name)
        if not m:
            return None
        layer = int(m.group(1))
        if m.group(4):
            return ExpertKey(layer, "gate_up" if m.group(4) == "gate_up_proj" else "down")
        half = self.halves[m.group(3)]
        return ExpertKey(layer, "down" if half is None else "gate_up", int(m.group(2)), half)


# llama.cpp's per-layer tensor names (blk.{l}.<name>.<weight|bias>) -> the layers' modules
GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # archs with post-norms name it so
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_gate",
}
GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# tensors whose GGUF suffix is not the parameter's: llama.cpp's converter writes the router's
# e_score_correction_bias as exp_probs_b.bias, attention sinks as attn_sinks.weight
GGUF_WHOLE = {
    ("exp_probs_b", "bias"): "mlp.gate.e_score_correction_bias",
    ("attn_sinks", "weight"): "self_attn.sinks",
}
# stacked expert tensors (blk.{l}.<name>.weight, and .bias where experts have biases); the
# fused gate_up form holds the gate rows before the up rows, as the banks do
GGUF_BANKS = {
    "ffn_gate_exps": ("gate_up", 0),
    "ffn_up_exps": ("gate_up", 1),
    "ffn_gate_up_exps": ("gate_up", None),
    "ffn_down_exps": ("down", None),
}
# older llama.cpp files keep one tensor per expert: blk.{l}.ffn_gate.{e}.weight
GGUF_PER_EXPERT = {"ffn_gate": ("gate_up", 0), "ffn_up": ("gate_up", 1), "ffn_down": ("down", None)}


class GgufNames:
    """A `gguf_key`: llama.cpp's tensor names to the model's names or expert banks; `layer`
    replaces or adds per-layer names where a family's modules differ, `whole` adds
    (kind, suffix) pairs named whole (as GGUF_WHOLE)."""

    def __init__(
        self,
        layer: Mapping[str, str] | None = None,
        whole: Mapping[tuple[str, str], str] | None = None,
    ):
        self.layer = {**GGUF_LAYER, **(layer or {})}
        self.whole = {**GGUF_WHOLE, **(whole or {})}

    def __call__(self, name: str) -> str | ExpertKey:
        parts = name.split(".")
        if parts[0] != "blk":
            return f"{GGUF_GLOBAL[parts[0]]}.{parts[-1]}"
        layer, kind, suffix = int(parts[1]), parts[2], parts[-1]
        if kind in GGUF_BANKS:
            bank, half = GGUF_BANKS[kind]
            bank = f"{bank}_bias" if suffix == "bias" else bank
            return ExpertKey(layer, bank, expert=None, half=half)
        if len(parts) == 5 and kind in GGUF_PER_EXPERT:
            bank, half = GGUF_PER_EXPERT[kind]
            return ExpertKey(layer, bank, expert=int(parts[3]), half=half)
        if (kind, suffix) in self.whole:
            return f"model.layers.{layer}.{self.whole[(kind, suffix)]}"
        return f"model.layers.{layer}.{self.layer[kind]}.{suffix}"


def gguf_base_config(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The Hub-style keys every llama.cpp decoder's metadata gives (`<arch>.block_count`, ...)."""

    def g(key: str, default: Any = None) -> Any:
        return kv.get(f"{arch}.{key}", default)

    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length", 0)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "num_experts_per_tok": int(g("expert_used_count", 0)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
    }


SIGMOID_GATING = 2  # llama.cpp's expert_gating_func for sigmoid scores


def require_sigmoid_gating(kv: Mapping[str, Any], arch: str) -> None:
    """Refuses a file whose experts are gated otherwise than by sigmoid scores (an absent
    key reads as sigmoid: older converters wrote none)."""
    gating = int(kv.get(f"{arch}.expert_gating_func", SIGMOID_GATING))
    if gating != SIGMOID_GATING:
        raise ValueError(f"{arch} GGUF with expert gating function {gating} (not sigmoid)")


def sigmoid_routing_info(arch: str, a: Any) -> dict[str, Any]:
    """The GGUF-style keys of grouped sigmoid routing beside shared experts after leading
    dense layers (DeepSeek-V3's, as GLM-4.5 and dots.llm1 route), from args holding its
    config's names."""
    return {
        f"{arch}.expert_shared_count": a.n_shared_experts,
        f"{arch}.leading_dense_block_count": a.first_k_dense_replace,
        f"{arch}.expert_group_count": a.n_group,
        f"{arch}.expert_group_used_count": a.topk_group,
        f"{arch}.expert_gating_func": SIGMOID_GATING,
        f"{arch}.expert_weights_scale": a.routed_scaling_factor,
        f"{arch}.expert_weights_norm": a.norm_topk_prob,
    }


def gguf_sigmoid_routing(
    kv: Mapping[str, Any], arch: str, *, shared: int, leading: int, norm: bool
) -> dict[str, Any]:
    """The config keys `sigmoid_routing_info` writes, read back from GGUF metadata (the
    defaults: what the family's converter leaves out)."""
    require_sigmoid_gating(kv, arch)

    def g(key: str, default: Any) -> Any:
        return kv.get(f"{arch}.{key}", default)

    return {
        "moe_intermediate_size": int(g("expert_feed_forward_length", 0)),
        "n_routed_experts": int(g("expert_count", 0)),
        "n_shared_experts": int(g("expert_shared_count", shared)),
        "first_k_dense_replace": int(g("leading_dense_block_count", leading)),
        "n_group": int(g("expert_group_count", 1)),
        "topk_group": int(g("expert_group_used_count", 1)),
        "routed_scaling_factor": float(g("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(g("expert_weights_norm", norm)),
    }
