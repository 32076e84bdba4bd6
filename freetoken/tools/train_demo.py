"""Trains the demo model: a small Qwen3-MoE that answers in words, from text Python ships.

    python -m freetoken.tools.train_demo OUT [--minutes M] [--device cuda]

The corpus is the standard library's own documentation (pydoc's text of modules, classes
and functions), laid out as chat turns: a question naming a module or function, answered
with its documentation in the demo's ChatML template, so the model learns where an answer
starts and that it ends with <|im_end|>. The model is the demo's Qwen3-MoE shape, written
as a Hugging Face directory with the names a real checkpoint uses; FreeToken serves it like
any other (tests compare this module's forward with transformers' on the written files).

The network here is for training only: plain torch, fp32, autograd, every expert computed
densely and weighted by the router (a few million parameters: the dense form costs less
than dispatching), with the usual load-balancing loss so every expert is used.
"""

from __future__ import annotations

import argparse
import json
import math
import pydoc
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.layers.rope import apply_rope
from freetoken.tools import synth

QUESTIONS = (
    "What does {} do?",
    "Explain {}.",
    "Tell me about {}.",
    "How do I use {}?",
    "What is {} for?",
)
# The modules whose documentation is the corpus: broad, stable, present in every CPython.
MODULES = (
    "builtins abc argparse array ast asyncio base64 bisect calendar cmd codecs collections "
    "configparser contextlib copy csv dataclasses datetime decimal difflib dis doctest email "
    "enum fractions functools getopt gettext glob gzip hashlib heapq hmac html http inspect io "
    "ipaddress itertools json locale logging math mimetypes multiprocessing operator optparse "
    "os pathlib pickle platform pprint queue random re sched secrets selectors shlex shutil "
    "signal smtplib socket sqlite3 statistics string struct subprocess sys tarfile tempfile "
    "textwrap threading time timeit tokenize traceback types typing unittest urllib uuid "
    "warnings weakref zipfile zlib"
).split()


def _documented(obj: Any, module: str) -> bool:
    owner = getattr(obj, "__module__", None) or ""
    return owner.lstrip("_").startswith(module) or module == "builtins"


def _entries() -> list[tuple[str, str]]:
    """(name, documentation) for each documented public module, class, function and method
    (a class's methods one level down)."""
    out, seen = [], set()

    def add(name: str, obj: Any) -> None:
        doc = pydoc.getdoc(obj).strip()
        if len(doc) > 60 and doc not in seen:
            seen.add(doc)
            out.append((name, doc))

    for module in MODULES:
        try:
            mod = __import__(module)
        except ImportError:
            continue
        add(module, mod)
        for attr in dir(mod):
            obj = getattr(mod, attr)
            if attr.startswith("_") or not _documented(obj, module):
                continue
            add(f"{module}.{attr}", obj)
            if isinstance(obj, type):
                for meth, member in vars(obj).items():
                    if not meth.startswith("_") and callable(member):
                        add(f"{module}.{attr}.{meth}", member)
    return out


def conversations(limit_chars: int = 700) -> list[str]:
    """The corpus: one ChatML conversation per entry, the answer its documentation's first
    paragraphs (up to `limit_chars`)."""
    rng = random.Random(0)
    texts = []
    for name, doc in _entries():
        answer = ""
        for para in doc.split("\n\n"):
            if answer and len(answer) + len(para) > limit_chars:
                break
            answer += ("\n\n" if answer else "") + para
        question = rng.choice(QUESTIONS).format(name)
        texts.append(
            f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\n{question}<|im_end|>\n"
            f"<|im_start|>assistant\n{answer[:limit_chars]}<|im_end|>\n"
        )
    return texts


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # not layers.norm.rms_norm: on a GPU that is a Triton kernel, which has no backward pass
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Layer(nn.Module):
    def __init__(self, c: dict[str, Any]):
        super().__init__()
        h, hd, e, i = c["hidden_size"], c["head_dim"], c["num_experts"], c["moe_intermediate_size"]
        self.c = c
        self.norms = nn.ParameterDict(
            {
                k: nn.Parameter(torch.ones(n))
                for k, n in (("in", h), ("post", h), ("q", hd), ("k", hd))
            }
        )
        self.q = nn.Linear(h, c["num_attention_heads"] * hd, bias=False)
        self.k = nn.Linear(h, c["num_key_value_heads"] * hd, bias=False)
        self.v = nn.Linear(h, c["num_key_value_heads"] * hd, bias=False)
        self.o = nn.Linear(c["num_attention_heads"] * hd, h, bias=False)
        self.router = nn.Linear(h, e, bias=False)
        self.gate_up = nn.Parameter(torch.randn(e, 2 * i, h) / math.sqrt(h))
        self.down = nn.Parameter(torch.randn(e, h, i) / math.sqrt(i))

    def forward(self, x, cos, sin):
        c, (B, T, _) = self.c, x.shape
        eps, hd = c["rms_norm_eps"], c["head_dim"]
        a = _rms(x, self.norms["in"], eps)
        q = apply_rope(_rms(self.q(a).view(B, T, -1, hd), self.norms["q"], eps), cos, sin)
        k = apply_rope(_rms(self.k(a).view(B, T, -1, hd), self.norms["k"], eps), cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v(a).view(B, T, -1, hd).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(att.transpose(1, 2).reshape(B, T, -1))
        m = _rms(x, self.norms["post"], eps)
        probs = self.router(m).softmax(-1)
        top, idx = probs.topk(c["num_experts_per_tok"], dim=-1)
        top = top / top.sum(-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter(-1, idx, top)
        g, u = torch.einsum("bth,eih->btei", m, self.gate_up).chunk(2, dim=-1)
        y = torch.einsum("btei,ehi,bte->bth", F.silu(g) * u, self.down, weights)
        # Switch-style balance: the share of routes each expert takes times its mean probability
        share = F.one_hot(idx, probs.shape[-1]).float().sum(-2).mean((0, 1)) / idx.shape[-1]
        balance = probs.shape[-1] * (share * probs.mean((0, 1))).sum()
        return x + y, balance


class DemoLM(nn.Module):
    """Qwen3-MoE's computation, for training (the layout `tensors` writes)."""

    def __init__(self, c: dict[str, Any]):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c["vocab_size"], c["hidden_size"])
        nn.init.normal_(self.embed.weight, std=1.0 / math.sqrt(c["hidden_size"]))
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = nn.Parameter(torch.ones(c["hidden_size"]))
        self.head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hd, T = self.c["head_dim"], ids.shape[1]
        inv = self.c["rope_theta"] ** (-torch.arange(0, hd, 2, device=ids.device) / hd)
        ang = torch.arange(T, device=ids.device)[:, None] * inv[None]
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        x, balance = self.embed(ids), 0.0
        for layer in self.layers:
            x, b = layer(x, cos, sin)
            balance = balance + b
        return self.head(_rms(x, self.norm, self.c["rms_norm_eps"])), balance / len(self.layers)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The weights under a Hugging Face Qwen3-MoE checkpoint's names."""
        t = {
            "model.embed_tokens.weight": self.embed.weight,
            "model.norm.weight": self.norm,
            "lm_head.weight": self.head.weight,
        }
        i = self.c["moe_intermediate_size"]
        for n, layer in enumerate(self.layers):
            p = f"model.layers.{n}."
            t |= {
                p + "input_layernorm.weight": layer.norms["in"],
                p + "post_attention_layernorm.weight": layer.norms["post"],
                p + "self_attn.q_norm.weight": layer.norms["q"],
                p + "self_attn.k_norm.weight": layer.norms["k"],
                p + "mlp.gate.weight": layer.router.weight,
            }
            for proj in "qkvo":
                t[p + f"self_attn.{proj}_proj.weight"] = getattr(layer, proj).weight
            for e in range(self.c["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                t[q + "gate_proj.weight"] = layer.gate_up[e, :i]
                t[q + "up_proj.weight"] = layer.gate_up[e, i:]
                t[q + "down_proj.weight"] = layer.down[e]
        return {k: v.detach().float().cpu().contiguous() for k, v in t.items()}


def batches(ids: list[int], seq: int, batch: int, rng: random.Random):
    """Endless batches of `batch` windows of seq + 1 tokens from the token stream."""
    data = torch.tensor(ids)
    while True:
        starts = [rng.randrange(0, len(ids) - seq - 1) for _ in range(batch)]
        yield torch.stack([data[s : s + seq + 1] for s in starts])


def train(
    config: dict[str, Any],
    ids: list[int],
    seconds: float,
    device: str = "cpu",
    seq: int = 256,
    batch: int = 32,
    lr: float = 3e-3,
    log: Any = print,
    steps: int = 0,
) -> DemoLM:
    """Trains for `seconds`, or for `steps` where given (warm-up then cosine decay over that
    time, or those steps: the same model on any machine); returns the model."""
    torch.manual_seed(0)
    model = DemoLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    rng, t0, step = random.Random(0), time.monotonic(), 0
    for xy in batches(ids, seq, batch, rng):
        done = step / steps if steps else (time.monotonic() - t0) / seconds
        if done >= 1:
            break
        scale = min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * done))
        for group in opt.param_groups:
            group["lr"] = lr * max(scale, 0.05)
        xy = xy.to(device)
        logits, balance = model(xy[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), xy[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss + 0.01 * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            b = float(balance.detach())
            log(f"step {step} ({done:.0%}): loss {loss.item():.3f}, balance {b:.3f}")
        step += 1
    return model.eval()


def write(out: Path, model: DemoLM, tokenizer: Any, dtype: str = "bfloat16") -> Path:
    """The trained model as a Hugging Face directory (the demo's tokenizer and template)."""
    shape = {k: v for k, v in model.c.items() if k not in ("vocab_size", "torch_dtype")}
    return synth.write_qwen3_moe(
        out, tokenizer=tokenizer, dtype=dtype, weights=model.tensors(), **shape
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the Hugging Face directory to write")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args(argv)
    from freetoken.tools import demo

    tokenizer = synth.train_tokenizer(demo.VOCAB_SIZE)
    texts = conversations()
    ids = [i for t in texts for i in tokenizer.encode(t).ids]
    config = synth.qwen3_moe_config(tokenizer.get_vocab_size(), **demo.DEMO_SHAPE)
    print(f"{len(texts)} conversations, {len(ids)} tokens; training on {args.device}")
    model = train(config, ids, args.minutes * 60, args.device, batch=args.batch)
    write(args.out, model, tokenizer)
    print(json.dumps({"out": str(args.out), "tokens": len(ids)}))


if __name__ == "__main__":
    main()
