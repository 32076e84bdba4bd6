"""Token sampling with Ollama's options.

Order, as Ollama's sampler applies them: repetition penalties over the last
`repeat_last_n` tokens, then top-k, temperature, softmax, top-p, min-p, and a draw from
the sequence's own seeded generator. Temperature 0 is greedy.

It runs where the logits are — on the GPU for a GPU model — and only the token id comes
back: on the host a step's sampling was milliseconds (an argmax over 150k logits, a sort of
them for a large top_k), against a few milliseconds for the whole decode step. A large top_k
keeps its tokens by a threshold (the k-th largest logit) instead of a sort, and without
top_p or min_p nothing is sorted at all. On a GPU a top_k up to 64 (Ollama's default is 40)
takes two Triton kernels (kernels/sample_gpu.py) in place of torch's score of launches, and
a larger top_k or none, where top_p keeps every candidate, the wide draw's few kernels.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from freetoken import options as opts
from freetoken.kernels import sample_gpu
from freetoken.layers import fused


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


def penalized(p: SamplingParams) -> bool:
    """Whether drawing for these parameters reads the sequence's past tokens."""
    return p.repeat_last_n != 0 and (
        p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    )


def apply_penalties(
    logits: torch.Tensor, history: list[int], p: SamplingParams, num_ctx: int
) -> torch.Tensor:
    if not history or not penalized(p):
        return logits
    if logits.is_cuda:
        return penalize_rows(logits[None], [history], p, num_ctx)[0]
    n = num_ctx if p.repeat_last_n < 0 else p.repeat_last_n
    return _penalize_seen(logits, torch.tensor(history[-n:], dtype=torch.long), p)


def _penalize_seen(logits: torch.Tensor, recent: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """On the CPU: only the logits of the tokens seen are read and rewritten."""
    ids, counts = torch.unique(recent, return_counts=True)
    vals = logits[ids]
    if p.repeat_penalty != 1.0:
        # divide positive logits, multiply negative ones: both push the token down
        vals = torch.where(vals > 0, vals * (1 / p.repeat_penalty), vals * p.repeat_penalty)
    vals = vals - p.frequency_penalty * counts.to(vals.dtype) - p.presence_penalty
    logits = logits.clone()
    logits[ids] = vals
    return logits


def penalize_rows(
    batch: torch.Tensor, histories: list[list[int]], p: SamplingParams, num_ctx: int
) -> torch.Tensor:
    """The penalties on each row of logits [B, V] from its own history, counted over the
    whole vocabulary by one scatter for the batch, the same arithmetic on every logit (equal
    to `_penalize_seen`'s, logit for logit). What a GPU runs: torch.unique's output has a
    data-dependent size, so the host would wait for the device there, and with the next
    step already launched (runtime/overlap.py) that wait took the step's whole forward."""
    n = num_ctx if p.repeat_last_n < 0 else p.repeat_last_n
    B, V = batch.shape
    ids = torch.tensor(
        [r * V + t for r, h in enumerate(histories) for t in h[-n:]], dtype=torch.long
    )
    if batch.is_cuda:
        # pinned: a copy from pageable memory first waits for the stream (the step launched
        # ahead)
        ids = ids.pin_memory().to(batch.device, non_blocking=True)
    counts = torch.zeros(B * V, dtype=batch.dtype, device=batch.device)
    counts.index_add_(0, ids, torch.ones_like(ids, dtype=batch.dtype))
    return _penalize_counts(batch, counts.view(B, V), p)


def _penalize_counts(logits: torch.Tensor, counts: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The penalties on logits of any shape, from each token's count in the recent history
    (`counts`, the logits' shape)."""
    seen = counts > 0
    if p.repeat_penalty != 1.0:
        # by the reciprocal, as CUDA divides by a scalar: the CPU's logits then equal the GPU's
        pushed = torch.where(logits > 0, logits * (1 / p.repeat_penalty), logits * p.repeat_penalty)
        logits = torch.where(seen, pushed, logits)
    return logits - p.frequency_penalty * counts - p.presence_penalty * seen.to(logits.dtype)


def _softmax(
    logits: torch.Tensor, top: torch.Tensor, temperature: float, best: torch.Tensor | int
) -> torch.Tensor:
    """Probabilities at `temperature`. The largest logit is 0 before scaling, so no
    temperature (1e-300 included) overflows; logits that were not finite to begin with
    put all the mass on the `best` token rather than NaN into the draw. No host sync."""
    probs = torch.softmax((logits - top) / temperature, dim=-1)
    # not `sure[best] = 1.0`: a 0-d device index is read on the host, and a number stored
    # by indexing is copied from host memory (both wait for the stream)
    sure = torch.zeros_like(probs)
    if isinstance(best, torch.Tensor):
        sure.index_fill_(0, best.view(1), 1.0)
    else:
        sure.narrow(0, best, 1).fill_(1.0)
    return torch.where(torch.isfinite(probs).all(), probs, sure)


# a byte of a bitmask -> the bounds of its 8 tokens: +inf where the bit is set, else -inf
_BOUND = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, np.inf, -np.inf)
_BOUND = _BOUND.astype(np.float32)


class _Scratch:
    """A device's tensors for applying bitmasks, kept between steps (on the CPU a fresh
    one would be a fresh allocation, which page-faults, on every step); one set a thread."""

    def __init__(self, device: torch.device):
        self.bound = torch.from_numpy(_BOUND).to(device)
        self.index = torch.empty(0, dtype=torch.int32, device=device)
        self.bounds = torch.empty(0, 8, device=device)
        self.host = np.empty((0, 8), dtype=np.float32)  # the CPU's, with numpy

    @torch.inference_mode(False)  # kept tensors: writable in and out of the mode
    def take(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index.numel() < nbytes:
            self.index = torch.empty(nbytes, dtype=torch.int32, device=self.bound.device)
            self.bounds = torch.empty(nbytes, 8, device=self.bound.device)
        return self.index[:nbytes], self.bounds[:nbytes]

    def take_host(self, nbytes: int) -> np.ndarray:
        if len(self.host) < nbytes:
            self.host = np.empty((nbytes, 8), dtype=np.float32)
        return self.host[:nbytes]


_LOCAL = threading.local()


def _scratch(device: torch.device) -> _Scratch:
    kept = getattr(_LOCAL, "kept", None)
    if kept is None:
        kept = _LOCAL.kept = {}
    if device not in kept:
        with torch.inference_mode(False):
            kept[device] = _Scratch(device)
    return kept[device]


@torch.inference_mode()  # the step's logits may be an inference tensor
def mask_bits(logits: torch.Tensor, bits: torch.Tensor, plans: list | None = None) -> None:
    """Rules out (-inf, in place) in fp32 logits [B, V] the tokens whose bit is clear in
    `bits`, host int32 words [B, W] in llguidance's layout (token t: bit t % 32 of word
    t // 32; tokens from 32·W on are ruled out; a free row is all ones), on every
    constrained step's path. On a GPU: one copy of the words and one kernel over the batch
    (kernels/triton/mask.py; three torch kernels where the fused kernels are off), whatever
    the masks hold. On the CPU: each row by its `host_plan` (`plans`: made
    beforehand, by the mask worker while the step ran).

    Where a whole row is passed over, each token's logit becomes the minimum of it and its
    bound (+inf or -inf), branchless: a masked fill or `where` by a bool mask mispredicts a
    branch a token on the CPU (40 times slower there), and `fmin` is not vectorized; a NaN
    logit stays NaN there (the draw's guard deals with rows that are not finite)."""
    B, V = logits.shape
    if fused.usable(logits):
        sample_gpu.mask_bits(logits, bits)
        return
    width = min(V, bits.shape[1] * 32)
    if width < V:
        logits[:, width:] = float("-inf")
    if logits.device.type != "cpu":
        _mask_device(logits, bits, width)
        return
    # numpy on this thread: after the step torch's OpenMP threads have gone to sleep, and
    # waking them for a pass of microseconds costs more than the pass
    out, words = logits.numpy(), bits.numpy().view(np.uint32)
    for r in range(B):
        plan = plans[r] if plans is not None else host_plan(words[r], width)
        _mask_row(out[r, :width], words[r], plan)


_ALL = np.uint32(0xFFFFFFFF)


def host_plan(words: np.ndarray, size: int) -> tuple[bool, np.ndarray] | None:
    """How a row's mask (uint32 words over `size` tokens) is best applied on the host:
    (False, the ids ruled out) or (True, the ids allowed) where few words hold them, else
    None: the row is passed over whole. Right after the step the logits are out of the
    cache and the memory is busy, so what counts is the bytes touched; grammars' masks rule
    out tokens in a few words (free text, a JSON string: a few hundred of 4,740) or allow
    tokens in a few (between JSON values)."""
    few = len(words) // 8
    part = np.flatnonzero(words != _ALL)  # words that rule a token out
    if len(part) <= few:
        return False, _ids(~words, part, size)
    some = np.flatnonzero(words)  # words that allow a token
    if len(some) <= few:
        return True, _ids(words, some, size)
    return None


def _mask_row(out: np.ndarray, words: np.ndarray, plan: tuple[bool, np.ndarray] | None) -> None:
    if plan is None:
        bounds = _scratch(torch.device("cpu")).take_host(words.size * 4)
        np.take(_BOUND, words.view(np.uint8), axis=0, out=bounds)
        np.minimum(out, bounds.reshape(-1)[: out.size], out=out)
    elif plan[0]:
        keep = out[plan[1]]
        out[:] = float("-inf")
        out[plan[1]] = keep
    else:
        out[plan[1]] = float("-inf")


def _ids(words: np.ndarray, where: np.ndarray, limit: int) -> np.ndarray:
    """The token ids below `limit` of the set bits of words[where]."""
    on = np.unpackbits(words[where].view(np.uint8), bitorder="little").reshape(-1, 32)
    row, bit = np.nonzero(on)
    ids = where[row] * 32 + bit
    return ids[ids < limit]


def _mask_device(logits: torch.Tensor, bits: torch.Tensor, width: int) -> None:
    """On the logits' device: one copy, which waits for nothing where `bits` is pinned, and
    three kernels over the batch."""
    dev, B = logits.device, logits.shape[0]
    scratch = _scratch(dev)
    # little-endian words read as bytes keep the token order: byte j holds tokens 8j..8j+7
    data = bits.to(dev, non_blocking=True).view(torch.uint8).view(-1)
    index, bounds = scratch.take(data.numel())
    index.copy_(data)
    torch.index_select(scratch.bound, 0, index, out=bounds)
    head = logits[:, :width]
    torch.minimum(head, bounds.view(B, -1)[:, :width], out=head)


def warm_up(vocab: int, device: torch.device) -> None:
    """Readies this device's sampling kernels for logits of `vocab` tokens (at load)."""
    if device.type == "cuda" and fused.ENABLED and vocab > 1:
        sample_gpu.warm_up(vocab, device)


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
    if logits.is_cuda and fused.ENABLED and sample_gpu.takes(p.top_k, V, p.top_p):
        u = torch.rand(1, device=logits.device, generator=generator)
        return sample_gpu.draw(logits, p.top_k, p.temperature, p.top_p, p.min_p, u)
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
    keep.narrow(0, 0, 1).fill_(True)  # the likeliest token always stays (no host copy)
    probs = probs.masked_fill(~keep, 0.0)
    choice = torch.multinomial(probs / probs.sum(), 1, generator=generator)
    return idx.index_select(0, choice)[0]  # idx[choice[0]] would read the choice on the host


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
