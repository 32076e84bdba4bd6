"""Random-weight models in the Hugging Face directory layout, for the demo, tests and benchmarks.

No weights can be downloaded on the machines FreeToken is developed on, so every model it is
built and measured against is generated here: a byte-level BPE tokenizer trained on the
Python standard library's docstrings, our own ChatML chat template, and seeded random
weights in the real architecture's checkpoint layout.
"""

from __future__ import annotations

import json
import math
import pydoc
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "CHAT_TEMPLATE_THINKING",
    "MARKUP_TOKENS",
    "SPECIAL_TOKENS",
    "qwen3_moe_config",
    "train_tokenizer",
    "write_checkpoint",
    "write_qwen3_next",
    "write_qwen3_moe",
    "write_tokenizer_files",
]

# Control tokens (never shown as text) and, as in Qwen3's tokenizer, markup tokens that are
# single tokens but ordinary text, so parsers can see them in the output.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

# ChatML with tools in the system turn and tool calls as <tool_call>{json}</tool_call>; the
# same conventions as the Qwen3 family, written for FreeToken.
CHAT_TEMPLATE = (
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else none -%}"
    "{%- if tools or sys is not none -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if sys is not none -%}{{- sys -}}"
    "{%- if tools -%}{{- '\\n\\n' -}}{%- endif -%}{%- endif -%}"
    "{%- if tools -%}"
    "{{- 'You can call these tools. Answer with "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.\\n<tools>\\n\' -}}'
    "{%- for t in tools -%}{{- t | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (m.content or '') -}}"
    "{%- for c in (m.tool_calls or []) -%}"
    "{{- '<tool_call>{\"name\": ' -}}{{- c.function.name | tojson -}}"
    "{{- ', \"arguments\": ' -}}{{- c.function.arguments | tojson -}}{{- '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The same with reasoning, for thinking models: an answer's reasoning is shown only for the
# answers after the last user message (the tool calls of the turn in progress), as Qwen3's
# template does, so a new user message changes how the earlier turns render.
CHAT_TEMPLATE_THINKING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    + CHAT_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' + (m.content or '') -}}",
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- if m.reasoning_content and loop.index0 > ns.last_user -%}"
        "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}"
        "{%- endif -%}"
        "{{- m.content or '' -}}",
    )
)

_CORPUS_MODULES = [
    "collections",
    "json",
    "re",
    "os",
    "pathlib",
    "functools",
    "itertools",
    "string",
    "textwrap",
    "argparse",
    "logging",
    "dataclasses",
    "enum",
    "heapq",
    "csv",
    "datetime",
    "decimal",
    "fractions",
    "statistics",
    "random",
    "shutil",
    "tempfile",
]


def _corpus() -> list[str]:
    chunks: list[str] = []
    for name in _CORPUS_MODULES:
        mod = __import__(name)
        for obj in [mod, *vars(mod).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40:
                chunks.append(pydoc.getdoc(obj))
    chunks.append("Hello! How are you? Why is the sky blue? café naïve 日本語 — 🙂")
    return chunks


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE `tokenizers.Tokenizer` trained on stdlib docstrings (deterministic)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def write_tokenizer_files(
    out: Path, vocab_size: int = 512, template: str = CHAT_TEMPLATE, tokenizer: Any = None
) -> int:
    """Writes tokenizer.json and tokenizer_config.json (of `tokenizer`, else one trained
    here); returns the vocabulary size."""
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else train_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": template,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": t in SPECIAL_TOKENS}
            for t in SPECIAL_TOKENS + MARKUP_TOKENS
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return tok.get_vocab_size()


def qwen3_moe_config(vocab_size: int, **overrides: Any) -> dict[str, Any]:
    """A Hub-style Qwen3-MoE config.json (the spelling real checkpoints use)."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": None,
    }
    cfg.update(overrides)
    return cfg


def _random_tensors(
    cfg: dict[str, Any], seed: int, dtype: str, embed_std: float = 0.0, experts: bool = True
) -> dict[str, Any]:
    return dict(_random_items(cfg, seed, dtype, embed_std, experts))


def _random_items(
    cfg: dict[str, Any], seed: int, dtype: str, embed_std: float = 0.0, experts: bool = True
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors one at a time, drawn in a fixed order from one generator (a
    writer may keep only a shard of them in memory)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)

    def mat(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).to(tdtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(tdtype)

    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nq, nkv, inter, e = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["moe_intermediate_size"],
        cfg["num_experts"],
    )
    yield "model.embed_tokens.weight", _embedding(v, h, embed_std, g).to(tdtype)
    yield "model.norm.weight", norm(h)
    yield "lm_head.weight", mat(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(h)
        yield p + "post_attention_layernorm.weight", norm(h)
        yield p + "self_attn.q_proj.weight", mat(nq * hd, h)
        yield p + "self_attn.k_proj.weight", mat(nkv * hd, h)
        yield p + "self_attn.v_proj.weight", mat(nkv * hd, h)
        yield p + "self_attn.o_proj.weight", mat(h, nq * hd)
        yield p + "self_attn.q_norm.weight", norm(hd)
        yield p + "self_attn.k_norm.weight", norm(hd)
        yield p + "mlp.gate.weight", mat(e, h)
        for x in range(e if experts else 0):
            q = f"{p}mlp.experts.{x}."
            yield q + "gate_proj.weight", mat(inter, h)
            yield q + "up_proj.weight", mat(inter, h)
            yield q + "down_proj.weight", mat(h, inter)


def save_sharded(items: Iterable[tuple[str, Any]], out: Path, shard_bytes: int) -> list[Path]:
    """Tensors saved as Hugging Face shards of about `shard_bytes` each
    (model-0000i-of-0000n.safetensors, with model.safetensors.index.json), one shard in
    memory at a time."""
    from safetensors.torch import save_file

    written: list[tuple[Path, list[str]]] = []
    shard: dict[str, Any] = {}
    size = total = 0

    def flush() -> None:
        path = out / f".shard-{len(written)}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, tensor in items:
        n = tensor.numel() * tensor.element_size()
        if shard and size + n > shard_bytes:
            flush()
            size = 0
        shard[name] = tensor
        size, total = size + n, total + n
    if shard or not written:
        flush()
    weight_map, paths = {}, []
    for i, (tmp, names) in enumerate(written):
        path = out / f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        tmp.rename(path)
        paths.append(path)
        weight_map.update(dict.fromkeys(names, path.name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return paths


def write_qwen3_moe(
    out: Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    dtype: str = "float32",
    template: str = CHAT_TEMPLATE,
    tokenizer: Any = None,
    embed_std: float = 0.0,
    weights: dict[str, Any] | None = None,
    experts: bool = True,
    shard_bytes: int = 0,
    **overrides: Any,
) -> Path:
    """A complete Qwen3-MoE directory: config, weights (`weights`, under a checkpoint's
    names, else random), tokenizer (`tokenizer`, else one trained to `vocab_size`),
    generation config; `embed_std` as in `_embedding`. `experts=False` leaves the routed
    experts' weights out (bench/synthftw.py writes them packed). `shard_bytes`: random
    weights in shards of about that size, drawn as they are written (a checkpoint larger
    than the RAM), where 0 writes one model.safetensors."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer_files(out, vocab_size, template, tokenizer)
    cfg = qwen3_moe_config(vocab, torch_dtype=dtype, **overrides)
    tok = json.loads((out / "tokenizer.json").read_text())
    eos = next(a["id"] for a in tok["added_tokens"] if a["content"] == "<|im_end|>")
    cfg["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"eos_token_id": [eos], "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if weights is not None:
        import torch

        weights = {k: v.to(getattr(torch, dtype)) for k, v in weights.items()}
    elif shard_bytes:
        save_sharded(_random_items(cfg, seed, dtype, embed_std, experts), out, shard_bytes)
        return out
    save_file(
        _random_tensors(cfg, seed, dtype, embed_std, experts) if weights is None else weights,
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out


def write_checkpoint(
    out: Path,
    config: dict[str, Any],
    dtype: str = "bfloat16",
    embed_std: float = 0.0,
    experts: bool = True,
) -> Path:
    """A random checkpoint of a Hub-style config (a benchmark shape), with the synthetic
    tokenizer and the thinking template; ValueError for a family without a writer here.
    `experts=False`: without the routed experts (Qwen3-MoE only)."""
    cfg = dict(config)
    model_type = cfg.pop("model_type")
    cfg.pop("vocab_size", None)  # the synthetic tokenizer's
    kw = {"dtype": dtype, "template": CHAT_TEMPLATE_THINKING, "embed_std": embed_std}
    if model_type == "qwen3_next" and experts:
        return write_qwen3_next(out, **kw, **cfg)
    if model_type != "qwen3_moe":
        raise ValueError(f"no synthetic checkpoint writer for {model_type!r}")
    return write_qwen3_moe(out, **kw, experts=experts, **cfg)


def _embedding(vocab: int, hidden: int, std: float, g: Any) -> Any:
    """The token embedding. By default scaled like every matrix (1/sqrt(hidden)): the
    token's row is then small beside what the layers add, so routing follows the context
    and barely the token, and even random sampling routes to the same experts step after
    step (a hot cache). With `std` (1.0: the scale of a normalised hidden state) the token
    steers routing, and sampling near-random tokens routes near-uniformly."""
    import torch

    x = torch.randn(vocab, hidden, generator=g)
    return x * std if std else x / math.sqrt(hidden)


# Qwen3-Next's checkpoint names its shared expert and gate so; the model file, otherwise
_QWEN3_NEXT_NAMES = (
    (".mlp.shared_experts.", ".mlp.shared_expert."),
    (".mlp.shared_gate.", ".mlp.shared_expert_gate."),
)


def write_qwen3_next(
    out: Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    dtype: str = "bfloat16",
    template: str = CHAT_TEMPLATE,
    embed_std: float = 0.0,
    **overrides: Any,
) -> Path:
    """A random Qwen3-Next directory (a hybrid of Gated DeltaNet and gated attention layers):
    its tensors are the model file's own, named as the Hub's checkpoints name them, the
    experts one tensor per expert and projection."""
    import torch
    from safetensors.torch import save_file

    from freetoken import models

    out.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer_files(out, vocab_size, template)
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}
    cfg |= {"vocab_size": vocab, "torch_dtype": dtype, "tie_word_embeddings": False, **overrides}
    with torch.device("meta"):
        model = models.load_class(cfg).from_config(cfg)
    g, tdtype = torch.Generator().manual_seed(seed), getattr(torch, dtype)
    tensors = {}
    for name, p in model.named_parameters():
        for ours, theirs in _QWEN3_NEXT_NAMES:
            name = name.replace(ours, theirs)
        if name == "model.embed_tokens.weight":
            tensors[name] = _embedding(*p.shape, embed_std, g).to(tdtype)
        else:
            tensors[name] = _random_like(tuple(p.shape), name, g).to(tdtype)
    for layer, spec in model.expert_specs().items():
        for x in range(cfg["num_experts"]):
            q = f"model.layers.{layer}.mlp.experts.{x}."
            for proj, shape in (
                ("gate", (spec.intermediate, spec.hidden)),
                ("up", (spec.intermediate, spec.hidden)),
                ("down", (spec.hidden, spec.intermediate)),
            ):
                tensors[f"{q}{proj}_proj.weight"] = _random_like(shape, proj, g).to(tdtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _random_like(shape: tuple[int, ...], name: str, g: Any) -> Any:
    """Matrices scaled by their fan-in, vectors near their identity (norms, gates' biases),
    decays in DeltaNet's usual range."""
    import torch

    if name.endswith("A_log"):
        return torch.log(1 + 15 * torch.rand(shape, generator=g))
    if len(shape) == 1 or name.endswith("dt_bias"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) / math.sqrt(shape[-1])
