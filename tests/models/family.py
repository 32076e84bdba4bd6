"""The checks every model family passes against transformers (fp32, tiny random configs):
a family's test module builds its reference model and calls these.

- logits of a prompt equal transformers' (relative error <= 1e-4);
- a cached decode (prefill, then one token at a time through the paged KV) equals the
  uncached forward;
- 32 greedy tokens equal transformers';
- sequences decoded together (continuous batching, prefill chunks beside decode) equal
  the same sequences alone;
- every expert policy, prefill streaming and a resized cache give the resident logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from freetoken.layers.context import SeqSpan, StepContext, step_context
from freetoken.moe.backend import ExpertsOps
from tests import fixtures
from tests.runtime.engine_util import full_logits, generate, make_engine

PROMPT = [5, 17, 99, 3, 250, 11, 7, 300, 42, 128, 64, 200]
LONG = [(7 * i + 3) % 500 for i in range(48)]  # longer than a decode step: streamed prefill


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def experts_of(engine):
    return ExpertsOps(engine.model).backend


def logits_match(path: Path, hf, prompt=PROMPT, tol: float = 1e-4) -> None:
    ours = full_logits(make_engine(path), prompt)
    ref = fixtures.hf_logits(hf, prompt)
    assert ours.shape == ref.shape
    assert rel(ours, ref) <= tol


def cached_decode_matches(path: Path, prompt=PROMPT) -> None:
    engine = make_engine(path, page_size=4)  # several pages per sequence
    full = full_logits(engine, prompt)
    kv = engine.kv
    pages = kv.pool.alloc(kv.pages_for(len(prompt)))
    rows = []
    for start, end in [(0, 5)] + [(i, i + 1) for i in range(5, len(prompt))]:
        ctx_slots = kv.slots_of(pages, 0, end, engine.device)
        span = SeqSpan(0, end - start, end, ctx_slots)
        ctx = StepContext(
            torch.arange(start, end), ctx_slots[start:], [span], kv, torch.arange(end - start)
        )
        with torch.inference_mode(), step_context(ctx):
            h = engine.model(torch.tensor(prompt[start:end]), ctx.positions)
            rows.append(engine.model.logits(h).float())
    kv.pool.release(pages)
    assert rel(torch.cat(rows), full) <= 1e-5


def greedy_matches(path: Path, hf, prompt=PROMPT, n: int = 32) -> None:
    (seq,) = generate(make_engine(path), [prompt], n)
    assert seq.output_ids == fixtures.hf_greedy(hf, prompt, n)


def batched_matches_single(path: Path, hf) -> None:
    prompts = [PROMPT, PROMPT[:7], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3]
    engine = make_engine(path, chunk=8, page_size=4, pages=128)
    for p, s in zip(prompts, generate(engine, prompts, 16)):
        assert s.output_ids == fixtures.hf_greedy(hf, p, 16)


def policies_match_resident(path: Path, num_experts: int, moe_layers: int) -> None:
    """Every policy at a cache too small for every expert, prefill streaming, and decode
    after shrinking and growing the cache: the resident model's logits and tokens."""
    every = num_experts * moe_layers
    resident = make_engine(path, policy="resident", slots=every)
    ref, ref_long = full_logits(resident, PROMPT), full_logits(resident, LONG)
    (want,) = generate(resident, [PROMPT], 12)
    small = max(num_experts + 1, every // 2)
    for policy, slots in [
        ("lru-pcie", small),
        ("cpu-misses", small),
        ("adaptive", small),
        ("adaptive", 0),
        ("static-layers", num_experts),
    ]:
        engine = make_engine(path, policy=policy, slots=slots)
        assert rel(full_logits(engine, PROMPT), ref) <= 1e-5, policy
        (seq,) = generate(engine, [PROMPT], 12)
        assert seq.output_ids == want.output_ids, policy
    streamed = make_engine(path, policy="lru-pcie", slots=max(2 * num_experts, small))
    assert experts_of(streamed).streamer is not None
    assert rel(full_logits(streamed, LONG), ref_long) <= 1e-5
    for size in (num_experts, every):
        experts_of(streamed).resize(size)
        assert rel(full_logits(streamed, PROMPT), ref) <= 1e-5
        (seq,) = generate(streamed, [PROMPT], 12)
        assert seq.output_ids == want.output_ids
