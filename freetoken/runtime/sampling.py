"""Token sampling with Ollama's options.

Order, as Ollama's sampler applies them: repetition penalties over the last
`repeat_last_n` tokens, then top-k, temperature, softmax, top-p, min-p, and a draw from
the sequence's own seeded generator. Temperature 0 is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from freetoken import options as opts


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1
    num_predict: int = -1
    stop: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SamplingParams:
        o = opts.merge(options)
        return cls(
            temperature=float(o["temperature"]),
            top_k=int(o["top_k"]),
            top_p=float(o["top_p"]),
            min_p=float(o["min_p"]),
            repeat_penalty=float(o["repeat_penalty"]),
            repeat_last_n=int(o["repeat_last_n"]),
            presence_penalty=float(o["presence_penalty"]),
            frequency_penalty=float(o["frequency_penalty"]),
            seed=int(o["seed"]),
            num_predict=int(o["num_predict"]),
            stop=tuple(o["stop"] or ()),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.seed < 0:
        return None
    return torch.Generator().manual_seed(params.seed)


def apply_penalties(
    logits: torch.Tensor, history: list[int], p: SamplingParams, num_ctx: int
) -> torch.Tensor:
    n = num_ctx if p.repeat_last_n < 0 else p.repeat_last_n
    if (
        n == 0
        or not history
        or (p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)
    ):
        return logits
    recent = torch.tensor(history[-n:], dtype=torch.long)
    ids, counts = torch.unique(recent, return_counts=True)
    vals = logits[ids]
    if p.repeat_penalty != 1.0:
        # divide positive logits, multiply negative ones: both push the token down
        vals = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    vals = vals - p.frequency_penalty * counts.to(vals.dtype) - p.presence_penalty
    logits = logits.clone()
    logits[ids] = vals
    return logits


def masked(logits: torch.Tensor, ids: np.ndarray, allow: bool) -> torch.Tensor:
    """fp32 logits [V] with only the tokens `ids` left (`allow`), or with `ids` ruled out
    (set to -inf in place): a scatter of the shorter list, not a pass over the vocabulary's
    mask, since this is on the path of every constrained step."""
    index = torch.from_numpy(ids)
    if allow:
        out = torch.full_like(logits, float("-inf"))
        out[index] = logits[index]
        return out
    with torch.inference_mode():  # the step's logits may be an inference tensor
        logits[index] = float("-inf")
    return logits


def sample(
    logits: torch.Tensor,
    history: list[int],
    p: SamplingParams,
    num_ctx: int,
    generator: torch.Generator | None,
) -> int:
    """One token from fp32 logits [V] (on the CPU)."""
    logits = apply_penalties(logits.float(), history, p, num_ctx)
    if p.greedy:
        return int(torch.argmax(logits))
    if 0 < p.top_k < logits.numel():
        vals, idx = torch.topk(logits, p.top_k)
    else:
        vals, idx = torch.sort(logits, descending=True)
    probs = torch.softmax(vals / p.temperature, dim=-1)
    keep = probs.numel()
    if 0.0 < p.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = min(keep, int(torch.searchsorted(cum, torch.tensor(p.top_p))) + 1)
    if p.min_p > 0.0:
        keep = min(keep, max(1, int((probs >= p.min_p * probs[0]).sum())))
    probs = probs[:keep]
    choice = torch.multinomial(probs / probs.sum(), 1, generator=generator)
    return int(idx[choice])


def token_logprobs(
    logits: torch.Tensor, token: int, top: int
) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability and the `top` most likely (id, log-probability),
    from the log-softmax of fp32 logits [V] (the model's distribution after the grammar mask,
    before penalties and temperature)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    alts: list[tuple[int, float]] = []
    if top > 0:
        vals, idx = torch.topk(lp, min(top, lp.numel()))
        alts = [(i, v) for i, v in zip(idx.tolist(), vals.tolist()) if v != float("-inf")]
    return float(lp[token]), alts
