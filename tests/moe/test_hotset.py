"""The expert cache's contents kept across loads: saved when serving pauses, restored first
when the same model loads again, and the model's tokens unchanged by where they came from."""

from __future__ import annotations

import pytest

from freetoken.moe import hotset
from freetoken.moe.hotset import HotSet
from tests import fixtures
from tests.runtime.engine_util import generate, make_engine

PROMPT = [5, 17, 99, 3, 250, 11, 7, 300, 42, 128]


def test_a_saved_set_reads_back_and_a_damaged_one_reads_as_nothing(tmp_path):
    hot = HotSet(tmp_path, "sha/256 key")
    assert hot.load() == {}
    hot.save({3: [7, 1, 2], 0: [5]})
    assert hot.load() == {0: [5], 3: [7, 1, 2]}
    assert HotSet(tmp_path, "another model").load() == {}
    hot.path.write_text("{not json")
    assert hot.load() == {}


def backend_of(engine):
    return engine.model.model.layers[0].mlp.experts.backend


def test_the_resident_experts_come_most_recent_first(tiny_model):
    path, _ = tiny_model
    backend = backend_of(make_engine(path, policy="lru-pcie", slots=9))
    cache = backend.cache
    cache.slot_of[:] = -1
    cache.slot_of[0, [4, 2]] = [0, 1]
    cache.slot_of[1, [6]] = [2]
    cache.last_use[[0, 1, 2]] = [10, 30, 20]
    assert hotset.resident(cache, [0, 1]) == {0: [2, 4], 1: [6]}


@pytest.fixture
def saved(tiny_model, tmp_path, monkeypatch):
    """What an adaptive engine's cache held after an answer, saved when it went idle."""
    path, _ = tiny_model
    hot = HotSet(tmp_path, "tiny")
    backend = backend_of(engine := make_engine(path, policy="adaptive", slots=9))
    backend.hot = hot
    backend.warm(seed=1)
    generate(engine, [PROMPT], 12)
    writes = []
    monkeypatch.setattr(hot, "save", lambda experts: (writes.append(1), HotSet.save(hot, experts)))
    backend.idle()  # within SAVE_EVERY_S of the load: not yet
    assert not writes
    monkeypatch.setattr(hotset, "SAVE_EVERY_S", 0.0)
    backend.idle()
    backend.idle()  # nothing served since: nothing to save again
    assert len(writes) == 1
    want = hotset.resident(backend.cache, list(backend.banks.layers))
    assert hot.load() == want and sum(map(len, want.values())) == 9
    return hot, want


def test_a_load_fills_the_cache_with_what_it_held_last(tiny_model, saved):
    path, hf = tiny_model
    hot, want = saved
    engine = make_engine(path, policy="adaptive", slots=9)
    backend = backend_of(engine)
    backend.hot = hot
    backend.warm(seed=7)  # another seed: a random fill would differ
    assert hotset.resident(backend.cache, list(backend.banks.layers)).keys() == want.keys()
    for layer, experts in want.items():
        assert all(backend.cache.slot_of[layer][e] >= 0 for e in experts)
    (seq,) = generate(engine, [PROMPT], 12)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 12)


def test_a_smaller_cache_takes_the_same_share_of_every_layer_the_recent_first(tiny_model, saved):
    path, _ = tiny_model
    hot, want = saved
    backend = backend_of(make_engine(path, policy="lru-pcie", slots=8))
    backend.placement._restore(want, list(backend.banks.layers))
    for layer, experts in want.items():
        kept = int(len(experts) * 8 / 9)
        have = backend.cache.slot_of[layer]
        assert all(have[e] >= 0 for e in experts[:kept])
        assert int((have >= 0).sum()) == kept
    assert int((backend.cache.owner >= 0).sum()) == sum(int(len(e) * 8 / 9) for e in want.values())
