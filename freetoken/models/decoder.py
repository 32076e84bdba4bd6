"""What the decoder-only model files share: embeddings, a stack of pre-norm layers, the
final norm and the output head, and the contract's defaults (models/base.py) built from the
layers.

A family subclasses `DecoderModel` and supplies its layers (`DecoderLayer` around its
attention and MLP, or its own); everything here reads only the modules the family built
(its `Experts` ops, its attention layers), never the family's name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from freetoken.layers.attention import Attention
from freetoken.layers.moe import Experts
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import RotaryEmbedding
from freetoken.models import common
from freetoken.models.base import ExpertSpec, KVLayout

_LAYER = re.compile(r"(?:model\.layers|blk)\.(\d+)\.")


def attention(a: Any, i: int, **options: Any) -> Attention:
    """Layer i's attention from a family's args `a` (hidden_size, num_attention_heads,
    num_key_value_heads, head_dim, and rms_norm_eps for q/k norms); `options` are the
    family's (Attention's keywords)."""
    heads, kv_heads = a.num_attention_heads, a.num_key_value_heads
    return Attention(i, a.hidden_size, heads, kv_heads, a.head_dim, eps=a.rms_norm_eps, **options)


class DecoderLayer(nn.Module):
    """x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x))."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """embed_tokens, the layers, the final norm, and the rotary tables the layers share."""

    def __init__(
        self, vocab: int, hidden: int, layers: list[nn.Module], eps: float, rotary: RotaryEmbedding
    ):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps)
        self.rotary = rotary

    @classmethod
    def of(
        cls, a: Any, layer: Callable[[Any, int], nn.Module], rotary: RotaryEmbedding
    ) -> DecoderStack:
        """The stack of a family's args `a` (vocab_size, hidden_size, num_hidden_layers,
        rms_norm_eps): layer i is `layer(a, i)`."""
        layers = [layer(a, i) for i in range(a.num_hidden_layers)]
        return cls(a.vocab_size, a.hidden_size, layers, a.rms_norm_eps, rotary)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, H]: a family that scales its embeddings does it here."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, H]
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


class DecoderModel(nn.Module):
    """`model` (embed_tokens, layers, norm) and `lm_head`, as Hub checkpoints name them.

    A family declares `Args`, its arguments' class (from_config reads a config with its
    from_dict), and hands its args and stack (most build a `DecoderStack.of` their layers)
    to __init__; each layer of `model.layers` must read `layers.context` for its cache and
    run over a flat batch. The KV layout defaults to each layer's `self_attn` (heads, head
    dim, window).
    """

    Args: ClassVar[type]

    def __init__(self, args: Any, model: nn.Module, *, head_bias: bool = False):
        super().__init__()
        self.args = args
        self.model = model
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=head_bias)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DecoderModel:
        return cls(cls.Args.from_dict(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [T, H] (logits are computed only where needed)."""
        return self.model(input_ids, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def tie_weights(self) -> None:
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _experts(self) -> dict[int, Experts]:
        return {m.layer: m for m in self.modules() if isinstance(m, Experts)}

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self._experts())

    def expert_specs(self) -> dict[int, ExpertSpec]:
        return {layer: m.spec for layer, m in sorted(self._experts().items())}

    def kv_layout(self) -> list[KVLayout]:
        return [self.layer_kv(i) for i in range(self.args.num_hidden_layers)]

    def layer_kv(self, i: int) -> KVLayout:
        attn = self.model.layers[i].self_attn
        return KVLayout.attention(attn.n_kv_heads, attn.head_dim, window=attn.window)

    @classmethod
    def ignored(cls, name: str, config: Mapping[str, Any]) -> bool:
        """Tensors of layers past num_hidden_layers (Hub `model.layers.{i}.`, GGUF `blk.{i}.`):
        the multi-token-prediction layers some checkpoints append, which no step runs."""
        m = _LAYER.match(name)
        return m is not None and int(m.group(1)) >= int(config["num_hidden_layers"])

    @staticmethod
    def dense_key(name: str) -> str:
        """Checkpoints name dense tensors as these modules do; a family that differs maps here."""
        return name

    # experts as most families' checkpoints name them (mlp.experts.{e}.gate_proj, ...) and
    # llama.cpp's GGUF names: a family that differs sets its own
    expert_key = staticmethod(common.ExpertNames())
    gguf_key = staticmethod(common.GgufNames())

    @staticmethod
    def gguf_float(key: str, config: Mapping[str, Any]) -> bool:
        """Whether the GGUF reader decodes this dense tensor before `gguf_tensor` (one whose
        columns the family reorders, which packed blocks do not allow)."""
        return False

    @staticmethod
    def gguf_tensor(
        key: str, t: torch.Tensor, fmt: str | None, config: Mapping[str, Any]
    ) -> tuple[torch.Tensor, str | None]:
        """A dense tensor of a GGUF file (float, or packed in block format `fmt`) under the
        model's name `key`, as the model's parameter holds it, and its format: as stored,
        unless the family's converters changed its values, shape or order (which the family
        then undoes here, from the file's `config`)."""
        return t, fmt

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError
