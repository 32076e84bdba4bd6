"""The model contract: what a model file declares, and the types it declares them in.

Kept free of torch: the server reads model facts without the engine, and the weight
readers, the expert kernels and the KV cache take these types as their whole knowledge of
a family. A family therefore adds a model file and touches nothing in `moe/`, `runtime/`
or `kernels/`.

A model file (`models/<model_type>.py`) defines `Model`, an `nn.Module` that satisfies
`ModelFile`: built from a config dict, it maps checkpoint tensor names to its own names or
to expert banks, says what each MoE layer's experts compute (`ExpertSpec`) and what a
token's cache entry holds in each layer (`KVLayout`), and runs a forward over a flat batch
whose per-step metadata it reads from `layers.context`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from freetoken import quant

__all__ = [
    "ACTIVATIONS",
    "GGUF_TENSORS",
    "ExpertKey",
    "ExpertSpec",
    "KVLayout",
    "ModelFile",
    "uniform_spec",
]

# Expert activations the kernels implement, by code (the C++ and Triton kernels take the code):
#   silu            h = silu(g) · u                                   (SwiGLU)
#   swiglu_clamped  g = min(g, limit), u = clamp(u, ±limit), h = (u + 1) · g · σ(alpha · g)
#   silu_clamped    g = min(g, limit), u = clamp(u, ±limit), h = silu(g) · u
ACTIVATIONS = ("silu", "swiglu_clamped", "silu_clamped")

# The key under which `config_from_gguf`'s metadata also holds the file's tensor names: some
# choices no metadata key states (GLM-4.5's q/k norms and biases) show in which tensors exist.
GGUF_TENSORS = "freetoken.tensor_names"


@dataclass(frozen=True, slots=True)
class ExpertKey:
    """Where a checkpoint tensor lands in the expert banks.

    bank: "gate_up" ([E, 2I, H], gate rows first), "down" ([E, H, I]), and with expert
        biases "gate_up_bias" ([E, 2I]) and "down_bias" ([E, H]).
    expert: the expert index for per-expert tensors; None when the tensor is the whole bank.
    half: for per-expert gate/up tensors, 0 = gate rows [0, I), 1 = up rows [I, 2I).
    transposed: the checkpoint stores the bank's last two dimensions swapped ([E, H, 2I]).
    interleaved: the checkpoint interleaves gate and up rows (g0, u0, g1, u1, ...); banks
        always hold them split.
    """

    layer: int
    bank: str
    expert: int | None = None
    half: int | None = None
    transposed: bool = False
    interleaved: bool = False


@dataclass(frozen=True, slots=True)
class ExpertSpec:
    """What one routed expert of a MoE layer computes, for every kernel that runs it:

        y = down · act(gate_up · x + b_gu) + b_down

    with gate_up's rows split as [gate; up]. The spec travels with the host banks to the
    CPU kernel, the GPU kernels, the slot pool and the weight readers.

    formats: the block format (freetoken/quant) the gate_up and down banks are packed in,
    "" for float banks. Model files never set it: the weights decide, layer by layer (a
    Q4_K_M file keeps some layers' down in Q6_K), so a backend holds one spec per layer
    that differ only here.
    """

    hidden: int
    intermediate: int
    activation: str = "silu"
    alpha: float = 1.702  # swiglu_clamped only
    limit: float = 7.0  # the clamped forms only
    bias: bool = False  # gate_up_bias [E, 2I] and down_bias [E, H] banks
    formats: tuple[str, str] = ("", "")

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown expert activation {self.activation!r} (one of {ACTIVATIONS})"
            )
        for fmt in self.formats:
            if fmt:
                quant.get(fmt)

    def format_of(self, bank: str) -> str:
        """The bank's block format; "" for a float bank (biases are always float)."""
        return {"gate_up": self.formats[0], "down": self.formats[1]}.get(bank, "")

    def format_code(self, bank: str) -> int:
        """The kernels' number for the bank's format (0: float)."""
        fmt = self.format_of(bank)
        return quant.get(fmt).code if fmt else 0

    @property
    def activation_code(self) -> int:
        return ACTIVATIONS.index(self.activation)

    @property
    def banks(self) -> tuple[str, ...]:
        """The banks of one layer, matrices first."""
        return (
            ("gate_up", "down", "gate_up_bias", "down_bias") if self.bias else ("gate_up", "down")
        )

    def rows(self) -> dict[str, tuple[int, ...]]:
        """One expert's row shape in each bank (in weights)."""
        H, two_i = self.hidden, 2 * self.intermediate
        shapes = {"gate_up": (two_i, H), "down": (H, self.intermediate)}
        if self.bias:
            shapes |= {"gate_up_bias": (two_i,), "down_bias": (H,)}
        return shapes

    def stored_rows(self) -> dict[str, tuple[int, ...]]:
        """One expert's shape in each bank as memory holds it: packed banks as uint8
        [rows, row_bytes]."""
        out = {}
        for bank, shape in self.rows().items():
            fmt = self.format_of(bank)
            out[bank] = quant.get(fmt).packed_shape(shape) if fmt else shape
        return out


def uniform_spec(specs: Mapping[int, ExpertSpec]) -> ExpertSpec:
    """The one ExpertSpec of a model's MoE layers (`ModelFile.expert_specs()`): the kernels
    take one expert shape and activation per backend, so layers that disagree are an error
    (the weights' formats are added per layer afterwards)."""
    found = set(specs.values())
    if len(found) != 1:
        raise ValueError(f"the model's MoE layers disagree on what an expert computes: {found}")
    return found.pop()


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What one layer keeps per cached token (or per sequence, for recurrent state).

    kind:
      attention   K [heads, k_dim] and V [heads, v_dim] per token (MHA, GQA, MQA);
      latent      one compressed vector of k_dim per token, heads = 1 and no V (MLA);
      compressed  one vector of k_dim per token that is key and value alike, heads = 1,
                  seen within `window`; and one entry of k_dim per `ratio` tokens, which a
                  compressor forms from its tokens' `inputs` (inputs_dim each, kept per
                  token) once the last of them is cached (DeepSeek-V4's compressed
                  attention);
      recurrent   a fixed-size state per sequence (`state` shapes), no per-token entry;
      none        nothing (a layer without attention).
    window: the keys a query sees, counting itself (0: all of them): sliding-window layers
        keep every page but attend to the last `window` positions.
    index_dim: an indexer key of this width beside each entry a query may attend to (a
        token's, or a compressed layer's entry): sparse attention scores them to choose.
    """

    kind: str
    heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    window: int = 0
    state: tuple[tuple[int, ...], ...] = ()
    index_dim: int = 0
    ratio: int = 0
    inputs_dim: int = 0

    KINDS: ClassVar[tuple[str, ...]] = ("attention", "latent", "compressed", "recurrent", "none")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"unknown KV layout {self.kind!r} (one of {self.KINDS})")
        if (self.kind == "compressed") != (self.ratio > 0):
            raise ValueError("a compressed layout, and only one, has a ratio")

    @property
    def paged(self) -> bool:
        """Whether the layer keeps an entry per token in the paged pool."""
        return self.kind in ("attention", "latent", "compressed")

    @classmethod
    def attention(cls, heads: int, head_dim: int, v_dim: int = 0, window: int = 0) -> KVLayout:
        return cls("attention", heads, head_dim, v_dim or head_dim, window)

    @classmethod
    def latent(cls, dim: int, index_dim: int = 0) -> KVLayout:
        return cls("latent", 1, dim, 0, index_dim=index_dim)

    @classmethod
    def compressed(
        cls, dim: int, window: int, ratio: int, inputs_dim: int, index_dim: int = 0
    ) -> KVLayout:
        return cls("compressed", 1, dim, 0, window, (), index_dim, ratio, inputs_dim)

    def entries_per_page(self, page_size: int) -> int:
        """A compressed layer's entries in a page: one per `ratio` of its tokens, or one
        per page where a window spans pages (each in the page its last token is in)."""
        if page_size % self.ratio and self.ratio % page_size:
            raise ValueError(
                f"a page of {page_size} tokens does not tile windows of {self.ratio} tokens"
            )
        return max(page_size // self.ratio, 1)

    def page_values(self, page_size: int) -> int:
        """Values one page of this layer holds (what the pool is sized by)."""
        if not self.paged:
            return 0
        # an index key sits beside every row, a compressed layer's token rows included
        row = self.heads * (self.k_dim + self.v_dim) + self.index_dim
        tokens = page_size * (row + self.inputs_dim)
        if self.kind != "compressed":
            return tokens
        return tokens + self.entries_per_page(page_size) * (self.k_dim + self.index_dim)


class ModelFile(Protocol):
    """The contract of every `models/<model_type>.py` `Model`.

    Construction and weights:
      from_config(config)     the model for a Hub-style config.json (built on the meta
                              device by the loader, so no weight is initialised twice);
      config_from_gguf(kv, arch)  a Hub-style config from GGUF metadata;
      expert_key(name)        where a checkpoint tensor goes among the expert banks, or None
                              for a dense weight;
      dense_key(name)         the model's own name for a dense checkpoint tensor;
      gguf_key(name)          the model's name for a GGUF tensor, or its ExpertKey;
      gguf_tensor(key, t, fmt, config)  a dense GGUF tensor (and its block format) as
                              the model's parameter holds it (what a converter folded in
                              or reordered, undone);
      gguf_float(key, config) whether the reader decodes that tensor first;
      ignored(name, config)   a checkpoint tensor the model does not use (a
                              multi-token-prediction layer after the last), skipped by
                              the weight readers (optional: none where absent);
      FP32                    parameters kept in fp32 whatever the model's dtype, as its
                              reference keeps them (module names or dotted tails;
                              optional: none where absent);
      tie_weights()           shares the embedding with the output head.
    Structure:
      args                    the parsed config (a frozen dataclass): `num_hidden_layers`,
                              `vocab_size` and `hidden_size` at least;
      moe_layers              the layers whose MLP is routed experts;
      expert_specs()          {layer: ExpertSpec} over moe_layers;
      kv_layout()             a KVLayout per layer, in order.
    Running:
      forward(input_ids [T], positions [T]) -> final hidden states [T, H];
      logits(hidden [n, H]) -> [n, V].
    Description (for `show` and the store, computed where torch is available):
      model_info(config)      GGUF-style metadata keys (`<arch>.context_length`, ...).
    """

    args: Any

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelFile: ...

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]: ...

    @staticmethod
    def expert_key(name: str) -> ExpertKey | None: ...

    @staticmethod
    def dense_key(name: str) -> str: ...

    @staticmethod
    def gguf_key(name: str) -> str | ExpertKey: ...

    @staticmethod
    def gguf_float(key: str, config: Mapping[str, Any]) -> bool: ...

    @staticmethod
    def gguf_tensor(
        key: str, t: Any, fmt: str | None, config: Mapping[str, Any]
    ) -> tuple[Any, str | None]: ...

    @classmethod
    def ignored(cls, name: str, config: Mapping[str, Any]) -> bool: ...

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]: ...

    @property
    def moe_layers(self) -> list[int]: ...

    def expert_specs(self) -> dict[int, ExpertSpec]: ...

    def kv_layout(self) -> list[KVLayout]: ...

    def tie_weights(self) -> None: ...

    def forward(self, input_ids: Any, positions: Any) -> Any: ...

    def logits(self, hidden: Any) -> Any: ...
