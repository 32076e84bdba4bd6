"""Token sampling with Ollama's options.

Order, as Ollama's sampler applies them: repetition penalties over the last
`repeat_last_n` tokens, then top-k, temperature, softmax, top-p, min-p, and a draw from
the sequence's own seeded generator. Temperature 0 is greedy.

It runs where the logits are — on the GPU for a GPU model — and only the token id comes
back: on the host a step's sampling was milliseconds (an argmax over 150k logits, a sort of
them for a large top_k), against a few milliseconds for the whole decode step. A large top_k
keeps its tokens by a threshold (the k-th largest logit) instead of a sort, and without
top_p or min_p nothing is sorted at all.
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


# up to this many kept tokens, top-k takes them sorted (cheap); more are kept by a threshold
SORTED_TOP_K = 1024


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The sequence's seeded generator, on the device its logits are sampled on."""
    if params.seed < 0:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


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
    recent = torch.tensor(history[-n:], dtype=torch.long, device=logits.device)
    ids, counts = torch.unique(recent, return_counts=True)
    vals = logits[ids]
    if p.repeat_penalty != 1.0:
        # divide positive logits, multiply negative ones: both push the token down
        vals = torch.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    vals = vals - p.frequency_penalty * counts.to(vals.dtype) - p.presence_penalty
    logits = logits.clone()
    logits[ids] = vals
    return logits


def _softmax(
    logits: torch.Tensor, top: torch.Tensor, temperature: float, best: torch.Tensor | int
) -> torch.Tensor:
    """Probabilities at `temperature`. The largest logit is 0 before scaling, so no
    temperature (1e-300 included) overflows; logits that were not finite to begin with
    put all the mass on the `best` token rather than NaN into the draw. No host sync."""
    probs = torch.softmax((logits - top) / temperature, dim=-1)
    sure = torch.zeros_like(probs)
    sure[best] = 1.0
    return torch.where(torch.isfinite(probs).all(), probs, sure)


def masked(logits: torch.Tensor, ids: np.ndarray, allow: bool) -> torch.Tensor:
    """fp32 logits [V] with only the tokens `ids` left (`allow`), or with `ids` ruled out
    (set to -inf in place): a scatter of the shorter list, not a pass over the vocabulary's
    mask, since this is on the path of every constrained step. The ids go to the logits'
    device without waiting for it (a host array is staged at once), so the step's one
    readback stays the only wait."""
    index = torch.from_numpy(ids).to(logits.device, non_blocking=True)
    if allow:
        out = torch.full_like(logits, float("-inf"))
        out[index] = logits[index]
        return out
    with torch.inference_mode():  # the step's logits may be an inference tensor
        logits[index] = float("-inf")
    return logits


def draw(
    logits: torch.Tensor,
    history: list[int],
    p: SamplingParams,
    num_ctx: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token (a 0-d tensor on the logits' device) from logits [V]; nothing waits for
    the device until the caller reads it."""
    logits = apply_penalties(logits.float(), history, p, num_ctx)
    if p.greedy:
        return torch.argmax(logits)
    V = logits.numel()
    if 0 < p.top_k <= min(SORTED_TOP_K, V - 1):
        vals, idx = torch.topk(logits, p.top_k)  # sorted, descending
    else:
        if 0 < p.top_k < V:  # the k largest, by the k-th largest value
            kth = torch.kthvalue(logits, V - p.top_k + 1).values
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p >= 1.0 and p.min_p <= 0.0:  # nothing needs them in order
            probs = _softmax(logits, logits.max(), p.temperature, torch.argmax(logits))
            return torch.multinomial(probs, 1, generator=generator)[0]
        vals, idx = torch.sort(logits, descending=True)
    probs = _softmax(vals, vals[0], p.temperature, 0)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if 0.0 < p.top_p < 1.0:
        # the smallest prefix whose mass reaches top_p (always at least one token)
        before = torch.cumsum(probs, dim=-1) - probs
        keep &= before < p.top_p
    if p.min_p > 0.0:
        keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    probs = probs.masked_fill(~keep, 0.0)
    choice = torch.multinomial(probs / probs.sum(), 1, generator=generator)
    return idx[choice[0]]


def sample(
    logits: torch.Tensor,
    history: list[int],
    p: SamplingParams,
    num_ctx: int,
    generator: torch.Generator | None,
) -> int:
    """One token from logits [V], as an int."""
    return int(draw(logits, history, p, num_ctx, generator))


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
