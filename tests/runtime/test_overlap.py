"""Decode steps launched before the last one's tokens are read give what waiting gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from tests.runtime.engine_util import generate, make_engine

PROMPTS = [
    [5, 17, 99, 3, 250, 11, 7],
    [300, 42],
    [128, 9, 14, 77, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
]


@pytest.fixture(scope="module")
def engines(tiny_model):
    path, _ = tiny_model
    return make_engine(path, graphs="eager"), make_engine(path, graphs="eager", overlap=True)


def _seqs(prompts, n, params, stop_ids=frozenset()):
    return [Sequence(list(p), params, n, stop_ids) for p in prompts]


def _run(engine, seqs, between=None) -> list[int]:
    """Steps until every sequence ends; `between(i)` runs before step i. The pool's free
    pages before and after."""
    free = engine.kv.pool.num_free
    for s in seqs:
        engine.submit(s, lambda *_: None)
    i = 0
    while not all(s.is_finished for s in seqs):
        if between is not None:
            between(i)
        engine.step()
        i += 1
    assert engine._ahead is None or not engine.scheduler.running
    return [free, engine.kv.pool.num_free]


def test_greedy_batch_matches_and_runs_ahead(engines):
    waiting, ahead = engines
    before = ahead.ahead_steps
    plain = generate(waiting, PROMPTS, 12)
    fast = generate(ahead, PROMPTS, 12)
    assert [s.output_ids for s in fast] == [s.output_ids for s in plain]
    assert all(len(s.output_ids) == 12 and s.finish_reason == "length" for s in fast)
    # a batch of three decodes 11 steps after its prefill: all but the first and the last
    # may run ahead (the last would be past every sequence's length)
    assert ahead.ahead_steps - before >= 9
    assert waiting.ahead_steps == 0
    # the steps that did not: the prefill, and the one whose next would pass the length
    assert ahead.ahead_refused["plan"] >= 1 and ahead.ahead_refused["ending"] >= 1
    assert not waiting.ahead_refused


def test_seeded_sampling_matches(engines):
    waiting, ahead = engines
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=11)
    outs = []
    for engine in engines:
        seqs = _seqs(PROMPTS, 10, params)
        _run(engine, seqs)
        outs.append([s.output_ids for s in seqs])
    assert outs[0] == outs[1]


def test_a_stop_token_ends_the_sequence_where_waiting_would(engines):
    waiting, ahead = engines
    greedy = SamplingParams(temperature=0.0)
    (ref,) = generate(waiting, PROMPTS[:1], 12)
    token = ref.output_ids[4]  # drawn while the step after it runs
    stop, at = frozenset({token}), ref.output_ids.index(token)
    outs = []
    for engine in engines:
        seqs = _seqs(PROMPTS, 12, greedy, stop)
        pages = _run(engine, seqs)
        assert pages[0] == pages[1]  # every page came back, the dropped step's included
        outs.append([(s.output_ids, s.finish_reason) for s in seqs])
    assert outs[0] == outs[1]
    assert outs[1][0] == (ref.output_ids[:at], "stop")


def test_a_request_arriving_mid_run_joins_the_batch(engines):
    outs = []
    for engine in engines:
        late = _seqs(PROMPTS[2:], 8, SamplingParams(temperature=0.0))
        seqs = _seqs(PROMPTS[:2], 14, SamplingParams(temperature=0.0))

        def arrive(i: int, engine=engine, late=late) -> None:
            if i == 5:
                engine.submit(late[0], lambda *_: None)

        _run(engine, seqs, arrive)
        while not late[0].is_finished:
            engine.step()
        outs.append([s.output_ids for s in seqs + late])
    assert outs[0] == outs[1]
    assert all(len(o) == n for o, n in zip(outs[1], (14, 14, 8)))


def test_an_abort_while_a_step_is_ahead(engines):
    waiting, ahead = engines
    seqs = _seqs(PROMPTS, 12, SamplingParams(temperature=0.0))
    free = ahead.kv.pool.num_free

    def abort(i: int) -> None:
        if i == 4:
            assert ahead._ahead is not None  # the abort lands while a step is in flight
            ahead.abort(seqs[1].id)

    _run(ahead, seqs, abort)
    assert seqs[1].finish_reason == "abort" and len(seqs[1].output_ids) < 12
    assert [len(s.output_ids) for s in (seqs[0], seqs[2])] == [12, 12]
    assert ahead.kv.pool.num_free == free
    (ref,) = generate(waiting, PROMPTS[:1], 12)
    assert seqs[0].output_ids == ref.output_ids


def test_calls_between_steps_wait_for_no_step_in_flight(engines):
    _, ahead = engines
    seen = []
    seqs = _seqs(PROMPTS[:1], 10, SamplingParams(temperature=0.0))

    def call(i: int) -> None:
        if i == 4:
            assert ahead._ahead is not None
            ahead.call_between_steps(lambda: seen.append(ahead._ahead))

    _run(ahead, seqs, call)
    assert seen == [None]


class _Allowed:
    """A constraint allowing a fixed set of token ids (the masks' forced-token path), that
    is finished after `n` tokens."""

    def __init__(self, size: int, allowed: tuple[int, ...], n: int):
        self.vocab = SimpleNamespace(size=size)
        self.allowed, self.n, self.taken = allowed, n, []

    @property
    def finished(self) -> bool:
        return len(self.taken) >= self.n

    def plan(self):
        return self.allowed

    def advance(self, token: int) -> None:
        self.taken.append(token)


@pytest.mark.parametrize(
    "params, extra",
    [
        (SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=8), {}),
        (SamplingParams(temperature=1.0, frequency_penalty=0.5, seed=3), {}),
        (SamplingParams(temperature=0.0), {"top_logprobs": 2}),
        (SamplingParams(temperature=1.0, seed=9), {"constraint": (tuple(range(3, 200, 7)), 7)}),
    ],
    ids=["repeat penalty", "frequency penalty", "logprobs", "mask"],
)
def test_sequences_that_read_their_history_run_ahead_alike(engines, params, extra):
    """Their tokens are drawn once the last step's are taken: the penalty, the logprobs and
    the mask of the token after are the waiting engine's."""
    waiting, ahead = engines
    before = ahead.ahead_steps
    outs = []
    for engine in engines:
        seqs = _seqs(PROMPTS[:2], 10, params)
        for s in seqs:
            if "top_logprobs" in extra:
                s.top_logprobs = extra["top_logprobs"]
            if "constraint" in extra:
                s.constraint = _Allowed(engine.vocab_size, *extra["constraint"])
        _run(engine, seqs)
        outs.append([(s.output_ids, s.logprobs, s.finish_reason) for s in seqs])
    assert outs[0] == outs[1]
    assert ahead.ahead_steps > before
    if "constraint" in extra:
        allowed, n = extra["constraint"]
        assert all(len(o) == n and set(o) <= set(allowed) for o, *_ in outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("policy,slots", [("resident", 0), ("lru-pcie", 12), ("adaptive", 9)])
def test_captured_steps_run_ahead_on_the_gpu(tiny_model, policy, slots):
    """On the device the step launched ahead really is in flight while the host reads the
    last one's tokens; the outputs are the waiting engine's, greedy and seeded. (A batch
    with experts off the device keeps the cache's books on the host: its steps are cut
    graphs, which do not run ahead; one sequence's are one graph.)"""
    path, _ = tiny_model
    prompts = PROMPTS if policy == "resident" else PROMPTS[:1]
    kw = {"device": "cuda", "graphs": "capture", "policy": policy, "slots": slots}
    waiting, ahead = make_engine(path, **kw), make_engine(path, overlap=True, **kw)
    plain, fast = (generate(e, prompts, 24) for e in (waiting, ahead))
    assert [s.output_ids for s in fast] == [s.output_ids for s in plain]
    assert ahead.ahead_steps >= 16 and ahead.graphs.capture
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=5)
    outs = []
    for engine in (waiting, ahead):
        seqs = _seqs(prompts, 24, params)
        _run(engine, seqs)
        outs.append([s.output_ids for s in seqs])
    assert outs[0] == outs[1]


def test_models_with_recurrent_state_do_not_run_ahead(tmp_path_factory):
    """A step launched ahead would move a sequence's recurrent state past a token that may
    end it (and anchors keep that state): a hybrid model's sequences wait for every step,
    the engine asked to overlap or not, and decode as the waiting engine's do."""
    from tests.models.test_qwen3_next import INTERVAL, _build

    path, _ = _build(tmp_path_factory, "qwen3-next-overlap", INTERVAL, seed=67)
    waiting = make_engine(path, graphs="eager")
    asked = make_engine(path, graphs="eager", overlap=True)
    assert asked.overlap and asked.state is not None
    params = SamplingParams(temperature=0.0)
    plain, fast = (_seqs(PROMPTS, 12, params) for _ in range(2))
    _run(waiting, plain)
    _run(asked, fast)
    assert [s.output_ids for s in fast] == [s.output_ids for s in plain]
    assert asked.ahead_steps == 0 and asked.ahead_refused["state"] > 0
