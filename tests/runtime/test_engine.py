"""The engine's failures stay with the sequence that caused them (issue 22: one request's
options, token ids or grammar used to end every stream of the batch with its error)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from freetoken.runtime import constrain
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from tests.runtime.engine_util import make_engine

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make_engine(tiny_model[0], max_running=4)


class _Broken:
    """A constraint whose mask cannot be planned (on the engine thread)."""

    finished = False

    def plan(self):
        raise RuntimeError("broken grammar")

    def advance(self, token: int) -> None:
        pass


class _BrokenMatcher(_Broken):
    """A constraint whose grammar's mask the worker cannot compute."""

    matcher = object()  # not a matcher: the engine's batched call refuses it

    def __init__(self, size: int):
        self.vocab = SimpleNamespace(size=size)

    def plan(self):
        return constrain.GRAMMAR


def _run(engine, seqs, outputs=None):
    ended: dict[int, list] = {s.id: [] for s in seqs}

    def on_output(seq, text, finished):
        if outputs is not None:
            outputs(seq, text, finished)
        ended[seq.id].append(finished)

    for s in seqs:
        engine.submit(s, on_output)
    for _ in range(200):
        if all(s.is_finished for s in seqs):
            break
        engine.step()
    assert all(s.is_finished for s in seqs)
    return ended


def _seq(n=6, **params) -> Sequence:
    return Sequence(list(PROMPT), SamplingParams(**{"temperature": 0.0, **params}), n, frozenset())


def test_a_broken_grammar_fails_its_sequence_alone(engine):
    good, bad, other = _seq(), _seq(), _seq(temperature=1e-300, seed=3)
    bad.constraint = _Broken()
    _run(engine, [good, bad, other])
    assert bad.finish_reason == "error" and "broken grammar" in bad.error
    assert good.finish_reason == "length" and len(good.output_ids) == 6
    assert other.finish_reason == "length" and other.output_ids == good.output_ids
    assert engine.kv.pool.num_free == engine.kv.pool.num_pages  # every page came back


def test_a_grammar_the_mask_worker_cannot_compute_fails_its_sequence_alone(engine):
    good, bad, planless = _seq(), _seq(), _seq()
    bad.constraint = _BrokenMatcher(engine.vocab_size)
    planless.constraint = _Broken()
    _run(engine, [good, bad, planless])
    assert bad.finish_reason == "error" and planless.finish_reason == "error"
    assert good.finish_reason == "length" and len(good.output_ids) == 6
    assert engine.kv.pool.num_free == engine.kv.pool.num_pages


def test_a_row_whose_draw_fails_fails_alone_though_drawn_with_others(engine, monkeypatch):
    """Rows alike draw together (runtime/batch_draw.py): where one of them fails the draw,
    each is drawn again alone and only that sequence ends, with the error."""
    from freetoken.runtime import batch_draw

    draw_rows = batch_draw.draw_rows

    def failing(scores, rows, histories, params, generators, num_ctx):
        if any(p.min_p == 0.5 for p in params):
            raise ValueError("cannot draw this row")
        return draw_rows(scores, rows, histories, params, generators, num_ctx)

    monkeypatch.setattr(batch_draw, "draw_rows", failing)
    good, bad, other = _seq(), _seq(min_p=0.5), _seq()
    _run(engine, [good, bad, other])
    assert bad.finish_reason == "error" and "cannot draw this row" in bad.error
    assert good.finish_reason == other.finish_reason == "length"
    assert good.output_ids == other.output_ids and len(good.output_ids) == 6
    assert engine.kv.pool.num_free == engine.kv.pool.num_pages


def test_out_of_vocabulary_ids_fail_their_sequence_before_the_step(engine):
    good = _seq()
    bad = Sequence([1, engine.vocab_size, 2], SamplingParams(), 4, frozenset())
    negative = Sequence([-3], SamplingParams(), 4, frozenset())
    _run(engine, [good, bad, negative])
    assert bad.finish_reason == "error" and f"token id {engine.vocab_size}" in bad.error
    assert negative.finish_reason == "error"
    assert good.finish_reason == "length" and len(good.output_ids) == 6


def test_an_output_callback_that_raises_fails_only_its_sequence(engine):
    good, bad = _seq(), _seq()

    def outputs(seq, text, finished):
        if seq is bad and not finished:
            raise ValueError("the parser choked")

    _run(engine, [good, bad], outputs)
    assert bad.finish_reason == "error" and "the parser choked" in bad.error
    assert good.finish_reason == "length" and len(good.output_ids) == 6


def test_a_failed_step_still_fails_everyone(engine, monkeypatch):
    # a fault of the step itself (not of one sequence) is every sequence's: the service
    # calls fail_all, and each ends with the error and gives its pages back
    seqs = [_seq(), _seq()]
    for s in seqs:
        engine.submit(s, lambda *_: None)
    engine.step()
    engine.fail_all("RuntimeError: device fault")
    assert all(s.finish_reason == "error" and s.error.endswith("fault") for s in seqs)
    assert engine.kv.pool.num_free == engine.kv.pool.num_pages
