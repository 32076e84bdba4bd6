"""Constrained decoding on the grammar engine: the vocabulary as bytes, masks against a
brute-force check of every token along random walks, thinking before the grammar and its
budget, and the engine generating under grammars with the random-weight model, among them
random schemas whose every output must validate."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer

from freetoken.chat.formats import GlmFormat, HarmonyFormat, QwenFormat
from freetoken.chat.formats.parser import OutputParser
from freetoken.chat.grammar import SchemaError, json_format
from freetoken.chat.structured import forced_tools, offered_tools
from freetoken.runtime.constrain import Constraint, Grammars, Thinking
from freetoken.runtime.masks import Masker
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from freetoken.runtime.vocab import Vocab, token_bytes
from tests.runtime import schemas
from tests.runtime.engine_util import make_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "exclusiveMaximum": 130},
        "ok": {"type": "boolean"},
        "day": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2,3}$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"anyOf": [{"type": "number", "multipleOf": 0.5}, {"type": "null"}]},
    },
    "required": ["name", "age", "ok", "day", "code"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make_engine(tiny_model[0], pages=128, num_ctx=1024)


@pytest.fixture(scope="module")
def grammars(engine):
    vocab = Vocab.from_tokenizer(engine.tokenizer.tok, engine.model.args.vocab_size)
    return Grammars(vocab, engine.tokenizer.eos_ids)


# -- the vocabulary --------------------------------------------------------------------------


def test_token_bytes_reassemble_any_text(tiny_model):
    tok = HFTokenizer.from_file(str(tiny_model[0] / "tokenizer.json"))
    data = token_bytes(tok)
    for text in ["Hello, world!", "café naïve 日本語 — 🙂", '{"a": [1, 2]}\n\t<tool_call>x']:
        ids = tok.encode(text).ids
        assert b"".join(data[i] for i in ids) == text.encode()
    assert data[tok.token_to_id("<|im_end|>")] == b""  # control tokens are not text
    assert data[tok.token_to_id("<tool_call>")] == b"<tool_call>"  # markup tokens are
    assert any(len(b) == 1 and b[0] >= 0x80 for b in data)  # bytes of split characters


def tricky_vocab() -> Vocab:
    """Every single byte, and tokens that cross JSON structure and UTF-8 characters; the last
    three ids are no text (the end token is the last)."""
    pieces = [bytes((b,)) for b in range(256)] + [
        b'{"',
        b'":',
        b'": "',
        b'",',
        b'", "',
        b'"}',
        b'"]',
        b"},",
        b"}]",
        b"[{",
        b" [",
        b" {",
        b"\n  ",
        b"\n\n",
        b"  ",
        b'\\"',
        b"\\n",
        b"\\u00",
        b"e9",
        b"true",
        b"false",
        b"null",
        b"12",
        b"-3",
        b"3.5",
        b"e+",
        b"name",
        b"age",
        b" ok",
        b"\xe6\x97",
        b"\xa5",
        b"\xe6\x97\xa5",
        b"\xf0\x9f",
        b"\x99\x82",
        "é".encode(),
        b'abc"',
        b'a"b',
        b"get_weather",
        b"<tool_call>",
        b"</tool_call>",
        b'{"name": "',
        b'"arguments": {',
        b"\xed\xa0",
        b"\xe0\x80",
    ]
    return Vocab(pieces + [b""], len(pieces) + 3)


TRICKY = tricky_vocab()
END = TRICKY.size - 1
TRICKY_GRAMMARS = Grammars(TRICKY, [END])


def allowed(c: Constraint) -> set[int]:
    return set(Masker().compute([c])[0].allowed().tolist())


def brute_force(c: Constraint) -> set[int]:
    """Every token the matcher takes by itself, token by token (not through its mask), and
    the end where the grammar is complete (forcing is off: even where the grammar leaves
    one way to go, every token that keeps to it is in the mask)."""
    m = c.matcher
    found = {t for t in range(TRICKY.size) if TRICKY.bytes[t] and m.validate_tokens([t]) == 1}
    return found | ({END} if m.is_accepting() else set())


@pytest.mark.parametrize(
    "grammar, schema",
    [
        (json_format(SCHEMA), SCHEMA),
        (json_format("json"), {"type": "object"}),
        (json_format({"type": "array", "items": {"type": "string", "maxLength": 3}}), None),
        (QwenFormat().call_grammar(forced_tools(TOOLS, None)), None),
        (QwenFormat().auto_grammar(offered_tools(TOOLS)), None),
        (GlmFormat().call_grammar(forced_tools(TOOLS, None)), None),
        (HarmonyFormat().auto_grammar(offered_tools(TOOLS)), None),
    ],
    ids=["schema", "json", "strings", "forced", "auto", "glm", "harmony"],
)
def test_masks_equal_brute_force_along_random_walks(grammar, schema):
    rng = random.Random(1)
    for _ in range(3):
        c = Constraint(TRICKY_GRAMMARS.matcher(grammar), TRICKY, [END], [END])
        text = b""
        for _ in range(40):
            mask = allowed(c)
            assert mask == brute_force(c)
            token = rng.choice(sorted(mask))
            if token == END:
                break
            c.advance(token)
            text += TRICKY.bytes[token]
        if schema is not None and c.matcher.is_accepting():
            schemas.validate(json.loads(text), schema)


def test_keywords_the_engine_cannot_enforce_are_refused_by_name():
    cases = [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
        ({"type": "string", "format": "colour"}, 'format "colour"'),
        ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf"),
    ]
    for schema, keyword in cases:
        with pytest.raises(SchemaError, match=keyword):
            TRICKY_GRAMMARS.matcher(json_format(schema))
    tool = {"name": "t", "parameters": {"type": "object", "properties": {"x": cases[0][0]}}}
    with pytest.raises(SchemaError, match='tool "t": schema keyword uniqueItems'):
        TRICKY_GRAMMARS.matcher(QwenFormat().call_grammar([tool]))
    # a tool offered under auto is held to what can be enforced; a strict one is not
    TRICKY_GRAMMARS.matcher(QwenFormat().auto_grammar([tool]))
    with pytest.raises(SchemaError, match="uniqueItems"):
        TRICKY_GRAMMARS.matcher(QwenFormat().auto_grammar([{**tool, "strict": True}]))


# -- thinking ----------------------------------------------------------------------------------


def think(**kw) -> Thinking:
    return Thinking(b"<think>", b"</think>", TRICKY.encode("</think>"), **kw)


def feed(c: Constraint, text: bytes) -> None:
    for b in text:  # ids 0..255 are the single bytes
        c.advance(b)


def test_the_grammar_waits_for_the_end_of_thinking():
    c = Constraint(
        TRICKY_GRAMMARS.matcher(json_format("json")), TRICKY, [END], [END], think(inside=True)
    )
    for b in b"hmm, {not json} </think":
        assert c.plan() is None  # thinking: free
        c.advance(b)
    c.advance(ord(">"))
    feed(c, b"\n\n")  # the line break before the answer, which the parser drops
    mask = allowed(c)
    assert ord("{") in mask and ord("a") not in mask and END not in mask and 10 not in mask
    feed(c, b"{}")
    assert c.finished


def test_the_first_token_may_open_thinking():
    v = Vocab([b"{", b"}", b"<think>", b"</think>", b"x", b""], 6)
    g = Grammars(v, [5])
    c = Constraint(g.matcher(json_format("json")), v, [5], [5], think_on(v))
    assert allowed_in(c) == {0, 2}
    c.advance(2)
    assert c.plan() is None  # thinking: free
    c.advance(4)
    c.advance(3)
    assert allowed_in(c) == {0}  # no second <think>
    c.advance(0)
    c.advance(1)
    assert c.finished


def think_on(v: Vocab) -> Thinking:
    return Thinking(b"<think>", b"</think>", [3], open_ids=[2])


def allowed_in(c: Constraint) -> set[int]:
    return set(Masker().compute([c])[0].allowed().tolist())


def test_a_spent_budget_forces_the_close_marker():
    v = Vocab([b"{", b"}", b"<think>", b"</think>", b"x", b""], 6)
    c = Constraint(None, v, [5], [5], Thinking(b"<think>", b"</think>", [3], budget=3, inside=True))
    for _ in range(3):
        assert c.plan() is None
        c.advance(4)
    assert allowed_in(c) == {3}  # the budget is spent: the thinking ends
    c.advance(3)
    assert c.plan() is None and not c.think.inside


def test_harmony_analysis_may_open_anywhere_and_its_budget_ends_it():
    t = Thinking(b"<|channel|>analysis<|message|>", b"<|end|>", [7], budget=2, anywhere=True)
    for piece in [b"<|channel|>", b"final", b"<|message|>", b"hi"]:
        t.advance(0, piece)
        assert not t.inside
    for piece in [b"<|end|><|start|>assistant<|chan", b"nel|>analysis<|message|>"]:
        t.advance(0, piece)
    assert t.inside and not t.over
    t.advance(0, b"so")
    t.advance(0, b" then")
    assert t.over
    t.advance(7, b"<|end|>")
    assert not t.inside


# -- the engine --------------------------------------------------------------------------------


def run(engine, prompt, params, constraint=None, top_logprobs=None, limit=400):
    seq = Sequence(list(prompt), params, limit, engine.tokenizer.eos_ids)
    seq.constraint = constraint
    seq.top_logprobs = top_logprobs
    engine.submit(seq, lambda *_: None)
    while not seq.is_finished:
        engine.step()
    return seq


def chat_prompt(engine, text="hi"):
    return engine.tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def constrained(engine, grammars, grammar, think=None):
    eos = engine.tokenizer.eos_ids
    return Constraint(grammars.matcher(grammar), grammars.vocab, eos, grammars.eos_ids, think)


@pytest.mark.parametrize("case", range(12))
def test_random_schemas_give_valid_instances(engine, grammars, case):
    rng = random.Random(case)
    schema = schemas.random_schema(rng)
    if case % 3 == 2:
        schema = schemas.with_ref(schema)
    p = SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.2]), seed=case, top_k=rng.choice([0, 40])
    )
    seq = run(
        engine,
        chat_prompt(engine, f"item {case}"),
        p,
        constrained(engine, grammars, json_format(schema)),
    )
    text = engine.tokenizer.decode(seq.output_ids)
    assert seq.finish_reason == "stop", (schema, text)
    assert "\n" not in text and "\t" not in text  # the compact layout
    schemas.validate(json.loads(text), schema)


def test_format_json_gives_an_object(engine, grammars):
    # A random model at temperature 0.9 wanders: some walks close the object within the
    # budget and some do not, and which ones do shifts with floating-point summation order.
    # So judge several walks: every one is compact JSON from its first character (a JSON
    # string holds no raw newline), every one that stopped parses as an object, some stop.
    stopped = 0
    for seed in range(6):
        seq = run(
            engine,
            chat_prompt(engine),
            SamplingParams(temperature=0.9, seed=seed),
            constrained(engine, grammars, json_format("json")),
        )
        text = engine.tokenizer.decode(seq.output_ids)
        assert text.startswith("{") and "\n" not in text and "\t" not in text, text
        if seq.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(text), dict), text
    assert stopped >= 2


def calls_of(engine, seq, style):
    parser = OutputParser(style, tools=True)
    return parser.feed(engine.tokenizer.decode(seq.output_ids)) + parser.finish()


@pytest.mark.parametrize("name", [None, "add"])
def test_forced_tool_calls_parse_and_validate(engine, grammars, name):
    style = QwenFormat(think_open=None, think_close=None)
    grammar = style.call_grammar(forced_tools(TOOLS, name), parallel=False)
    for seed in range(3):
        p = SamplingParams(temperature=1.0, seed=seed)
        seq = run(
            engine, chat_prompt(engine, "weather?"), p, constrained(engine, grammars, grammar)
        )
        events = calls_of(engine, seq, style)
        calls = [c["function"] for e in events for c in e.get("tool_calls", [])]
        assert seq.finish_reason == "stop" and len(calls) == 1, events
        assert not [e for e in events if e.get("content", "").strip()], events
        for fn in calls:
            assert fn["name"] == (name or fn["name"]) and fn["name"] in PARAMS
            schemas.validate(fn["arguments"], PARAMS[fn["name"]])


def test_a_call_opened_under_auto_follows_its_schema(engine, grammars, monkeypatch):
    style = QwenFormat(think_open=None, think_close=None)
    opener = engine.tokenizer.tok.token_to_id("<tool_call>")
    logits = engine.model.logits

    def eager_to_call(hidden):
        out = logits(hidden)
        out[:, opener] += 8.0  # so the random model opens a call soon
        return out

    monkeypatch.setattr(engine.model, "logits", eager_to_call)
    grammar = style.auto_grammar(offered_tools(TOOLS))
    for seed in range(3):
        c = constrained(engine, grammars, grammar)
        seq = run(
            engine, chat_prompt(engine), SamplingParams(temperature=1.0, seed=seed), c, limit=120
        )
        events = calls_of(engine, seq, style)
        calls = [c["function"] for e in events for c in e.get("tool_calls", [])]
        assert calls, events
        for fn in calls:
            schemas.validate(fn["arguments"], PARAMS[fn["name"]])


def test_the_grammar_applies_once_thinking_ends(engine, grammars, monkeypatch):
    tok = engine.tokenizer
    close = tok.tok.token_to_id("</think>")
    logits = engine.model.logits

    def eager_to_stop_thinking(hidden):
        out = logits(hidden)
        out[:, close] += 6.0  # so the random model ends its thinking soon
        return out

    monkeypatch.setattr(engine.model, "logits", eager_to_stop_thinking)
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    for seed in range(3):
        t = Thinking(b"<think>", b"</think>", [close], inside=True)
        c = constrained(engine, grammars, json_format(SCHEMA), t)
        seq = run(engine, prompt, SamplingParams(temperature=1.0, seed=seed), c)
        parser = OutputParser(QwenFormat(), thinking=True)
        events = parser.feed(tok.decode(seq.output_ids)) + parser.finish()
        assert seq.finish_reason == "stop" and close in seq.output_ids
        answer = "".join(e.get("content", "") for e in events)
        schemas.validate(json.loads(answer), SCHEMA)


def test_a_thinking_budget_bounds_the_thinking(engine, grammars):
    tok = engine.tokenizer
    close = tok.tok.token_to_id("</think>")
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    t = Thinking(b"<think>", b"</think>", [close], budget=5, inside=True)
    c = Constraint(None, grammars.vocab, tok.eos_ids, grammars.eos_ids, t)
    seq = run(engine, prompt, SamplingParams(temperature=1.0, seed=3, num_predict=30), c, limit=30)
    assert seq.output_ids.index(close) <= 5


def test_unconstrained_sequences_are_untouched(engine, grammars):
    prompt = chat_prompt(engine)
    free = run(engine, prompt, SamplingParams(temperature=0.0), limit=20)
    seq = Sequence(list(prompt), SamplingParams(temperature=0.0), 30, engine.tokenizer.eos_ids)
    seq.constraint = constrained(engine, grammars, json_format("json"))
    together = Sequence(list(prompt), SamplingParams(temperature=0.0), 20, engine.tokenizer.eos_ids)
    for s in (seq, together):
        engine.submit(s, lambda *_: None)
    while not (seq.is_finished and together.is_finished):
        engine.step()
    assert together.output_ids == free.output_ids  # batched with a constrained one: the same


def test_logprobs_come_from_the_log_softmax(engine):
    seq = run(
        engine, chat_prompt(engine), SamplingParams(temperature=0.0, num_predict=5), top_logprobs=3
    )
    assert len(seq.logprobs) == len(seq.output_ids)
    for (token, lp, alts), out in zip(seq.logprobs, seq.output_ids):
        assert token == out and lp <= 0.0
        assert [a[1] for a in alts] == sorted((a[1] for a in alts), reverse=True) and len(alts) == 3
        assert alts[0][0] == token and alts[0][1] == pytest.approx(lp)  # greedy: the best one
