"""Prefill by whole-layer streaming gives the resident model's logits (CPU emulation of the
pool)."""

from __future__ import annotations

import pytest

from tests import fixtures
from tests.runtime.engine_util import full_logits, generate, make_engine

LONG = [(7 * i + 3) % 500 for i in range(48)]  # longer than a decode batch: streamed


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("policy", ["lru-pcie", "adaptive", "cpu-misses"])
def test_streamed_prefill_matches_resident(three_layers, policy):
    """20 of the 24 experts fit (a pool that holds them all fixes them instead: nothing to
    stream)."""
    path, hf = three_layers
    ref = full_logits(make_engine(path, policy="resident", slots=24), LONG)
    engine = make_engine(path, policy=policy, slots=20)
    backend = engine.model.model.layers[0].mlp.experts.backend
    assert backend.streamer is not None
    assert _rel(full_logits(engine, LONG), ref) <= 1e-5
    s = backend.streamer.stats
    assert (
        s["chunks"] == 1 and s["h2d_experts"] + s["d2d_experts"] == 3 * 8
    )  # three layers of 8 experts


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-3-layers")
    return path, fixtures.hf_qwen3_moe(path, seed=5, num_hidden_layers=3)


def test_cached_experts_are_copied_on_the_device_and_decode_follows(three_layers):
    path, hf = three_layers
    engine = make_engine(path, policy="lru-pcie", slots=20, chunk=64)
    backend = engine.model.model.layers[0].mlp.experts.backend
    (seq,) = generate(engine, [LONG[:5]], 12)  # short prompt and decode: the LRU cache fills
    assert seq.output_ids == fixtures.hf_greedy(hf, LONG[:5], 12)
    (seq,) = generate(engine, [LONG], 12)  # a long prompt: streamed, partly from cached slots
    assert seq.output_ids == fixtures.hf_greedy(hf, LONG, 12)
    assert backend.streamer.stats["d2d_experts"] > 0
    c = backend.cache
    assert not c.fixed.any()  # the buffers went back to the pool
    owned = c.owner[c.owner >= 0]
    assert len(set(owned.tolist())) == len(owned)


def test_no_streaming_when_the_pool_cannot_hold_two_layers(tiny_model):
    path, hf = tiny_model
    engine = make_engine(path, policy="lru-pcie", slots=12)
    assert engine.model.model.layers[0].mlp.experts.backend.streamer is None
    (seq,) = generate(engine, [LONG], 8)
    assert seq.output_ids == fixtures.hf_greedy(hf, LONG, 8)
