"""Qwen3-MoE against transformers on tiny random configs (fp32, decisive routing)."""

from __future__ import annotations

import pytest
import torch

from tests import fixtures
from tests.runtime.engine_util import full_logits, generate, make_engine

PROMPT = [5, 17, 99, 3, 250, 11, 7, 300, 42, 128, 64, 200]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_fused", "tiny_model_sharded"])
def test_logits_match_transformers(fixture, request):
    path, hf = request.getfixturevalue(fixture)
    engine = make_engine(path)
    ours = full_logits(engine, PROMPT)
    ref = fixtures.hf_logits(hf, PROMPT)
    assert ours.shape == ref.shape
    assert _rel(ours, ref) <= 1e-4


def test_cached_decode_equals_uncached_forward(tiny_model):
    path, _ = tiny_model
    engine = make_engine(path, page_size=4)  # several pages per sequence
    full = full_logits(engine, PROMPT)
    # prefill the first 5 tokens, then feed the rest one by one through the KV cache
    from freetoken.layers.context import SeqSpan, StepContext, step_context

    kv = engine.kv
    pages = kv.pool.alloc(kv.pages_for(len(PROMPT)))
    rows = []
    for start, end in [(0, 5)] + [(i, i + 1) for i in range(5, len(PROMPT))]:
        ctx_slots = kv.slots_of(pages, 0, end, engine.device)
        ctx = StepContext(
            torch.arange(start, end),
            ctx_slots[start:],
            [SeqSpan(0, end - start, end, ctx_slots)],
            kv,
            torch.arange(end - start),
        )
        with torch.inference_mode(), step_context(ctx):
            h = engine.model(torch.tensor(PROMPT[start:end]), ctx.positions)
            rows.append(engine.model.logits(h).float())
    kv.pool.release(pages)
    assert _rel(torch.cat(rows), full) <= 1e-5


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_fused"])
def test_greedy_continuation_matches_transformers(fixture, request):
    path, hf = request.getfixturevalue(fixture)
    engine = make_engine(path)
    (seq,) = generate(engine, [PROMPT], 32)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 32)


def test_batched_sequences_match_single(tiny_model):
    """Continuous batching (decode + prefill chunks in one step) changes no result."""
    path, hf = tiny_model
    prompts = [PROMPT, PROMPT[:7], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3]
    engine = make_engine(path, chunk=8, page_size=4, pages=128)
    seqs = generate(engine, prompts, 16)
    for p, s in zip(prompts, seqs):
        assert s.output_ids == fixtures.hf_greedy(hf, p, 16)


def test_show_describes_the_model_from_its_model_file(tiny_model, tmp_path):
    """The converted model's index carries the model file's description; show's parameter
    counts are the tensors' own: the total is transformers' parameter count, the active one
    the dense part plus top-k of the experts."""
    import json

    from freetoken import models
    from freetoken.ftw.convert import convert

    path, hf = tiny_model
    out = convert(path, tmp_path / "ftw")
    index = json.loads((out / "ftw.json").read_text())
    config = json.loads((out / "config.json").read_text())
    info = models.model_info(config, index)
    assert info["general.architecture"] == "qwen3moe"
    assert info["qwen3moe.expert_count"] == 8 and info["qwen3moe.expert_used_count"] == 2
    assert info["general.parameter_count"] == sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    dense = info["general.parameter_count"] - experts
    assert info["general.active_parameter_count"] == dense + experts * 2 // 8
