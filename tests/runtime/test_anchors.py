"""Recurrent-state checkpoints at anchors: the store, and a hybrid model resumed from one
giving a full prefill's logits."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime.anchors import MARK_SPACING, AnchorStore
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from tests.models.test_qwen3_next import INTERVAL, _build
from tests.runtime.engine_util import full_logits, generate, make_engine


def _state(nbytes: int) -> list[torch.Tensor]:
    return [torch.zeros(nbytes // 4)]


def test_the_longest_anchor_inside_the_limit_is_found():
    store = AnchorStore(1 << 20)
    store.save([1, 2, 3], _state(64))
    store.save([1, 2, 3, 4, 5], _state(64))
    store.save([1, 9], _state(64))
    assert store.find([1, 2, 3, 4, 5, 6], 6).tokens == (1, 2, 3, 4, 5)
    assert store.find([1, 2, 3, 4, 5, 6], 4).tokens == (1, 2, 3)
    assert store.find([1, 2, 7], 3) is None
    assert store.has([1, 9]) and not store.has([1, 2])


def test_the_least_recently_used_anchor_goes_first():
    store = AnchorStore(256)
    store.save([1], _state(100))
    store.save([2], _state(100))
    store.find([1, 5], 2)  # [1] is used
    store.save([3], _state(100))
    assert store.has([1]) and store.has([3]) and not store.has([2])
    assert store.used == 200
    store.save([4], _state(1000))  # larger than the budget: not kept, nothing evicted
    assert len(store) == 2


BOUNDARY = 7  # the token after which the tests' prompts have boundaries


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path, _ = _build(tmp_path_factory, "qwen3-next-anchors", INTERVAL, seed=61)
    return make_engine(
        path, pages=256, page_size=4, prefix_cache=True, anchor_ids=frozenset({BOUNDARY})
    )


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 200, (n,), generator=g).tolist()
    return ids


def _first_logits(engine, ids: list[int]) -> tuple[torch.Tensor, Sequence]:
    """The logits the engine samples a new sequence's first token from."""
    seen: list[torch.Tensor] = []
    logits = engine.model.logits

    def keep(hidden):
        out = logits(hidden)
        seen.append(out.float().cpu())
        return out

    seq = Sequence(list(ids), SamplingParams(temperature=0.0), 1, frozenset())
    engine.model.logits = keep
    try:
        engine.submit(seq, lambda *_: None)
        while not seq.is_finished:
            engine.step()
    finally:
        del engine.model.logits
    return seen[-1][-1], seq


def test_a_turn_resumes_from_the_last_one_and_matches_a_full_prefill(engine):
    turn1 = _prompt(21, 1) + [BOUNDARY] + _prompt(9, 2) + [BOUNDARY] + [3, 4]
    (first,) = generate(engine, [turn1], 5)
    # the next turn repeats all of it, the answer as generated, and adds a message
    turn2 = turn1 + first.output_ids + _prompt(6, 3)
    got, seq = _first_logits(engine, turn2)
    assert seq.cached_tokens == len(turn1) + 4  # the first turn's end: all it fed
    ref = full_logits(engine, turn2)[-1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_an_edited_history_resumes_from_the_boundary_before_the_edit(engine):
    turn1 = _prompt(30, 4) + [BOUNDARY] + _prompt(11, 5)
    generate(engine, [turn1], 2)
    edited = turn1[:31] + _prompt(8, 6)  # the last message replaced
    got, seq = _first_logits(engine, edited)
    assert seq.cached_tokens == 31
    torch.testing.assert_close(got, full_logits(engine, edited)[-1], rtol=1e-4, atol=1e-4)


def test_resumed_sequences_decode_as_fresh_ones(engine):
    base = _prompt(25, 7) + [BOUNDARY] + _prompt(5, 8)
    generate(engine, [base], 3)
    prompts = [base + _prompt(4, 10 + i) for i in range(3)]
    fresh = [s.output_ids for s in generate(engine, prompts, 6, reuse=False)]
    resumed = generate(engine, prompts, 6)
    assert [s.output_ids for s in resumed] == fresh
    assert all(s.cached_tokens >= len(base) for s in resumed)


def test_an_edit_inside_a_long_prefill_resumes_from_a_mark_in_it(engine):
    """Boundaries inside one prefill chunk are kept without cutting it (the recurrent
    layers' state at each mark): an edit after one resumes there, not at the start."""
    engine.anchoring.spacing = 8
    try:
        parts = [_prompt(12, 20 + i) + [BOUNDARY] for i in range(4)]
        turn1 = [t for part in parts for t in part] + _prompt(6, 30)
        saved = engine.anchoring.store.saved
        generate(engine, [turn1], 2)
        assert engine.anchoring.store.saved - saved >= 3  # marks at 13 and 26, then the cuts
        edited = turn1[:26] + _prompt(9, 31)  # the third message replaced
        got, seq = _first_logits(engine, edited)
        assert seq.cached_tokens == 26
        torch.testing.assert_close(got, full_logits(engine, edited)[-1], rtol=1e-4, atol=1e-4)
    finally:
        engine.anchoring.spacing = MARK_SPACING
