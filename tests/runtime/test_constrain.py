"""Token masks from grammars: the vocabulary as bytes, the trie walk, masks against brute
force, and the engine generating under a grammar with the random-weight model."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from freetoken.chat.formats.parser import OutputParser
from freetoken.chat.formats.qwen import QwenFormat
from freetoken.chat.jsonfsm import Grammar
from freetoken.chat.schema import ANY_OBJECT
from freetoken.chat.structured import format_grammar, tool_call_grammar
from freetoken.runtime.constrain import Constraint, GrammarMasks, MaskCache
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from freetoken.runtime.vocab import Trie, Vocab, token_bytes
from tests.runtime.engine_util import make_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["name", "age", "ok"],
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


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make_engine(tiny_model[0], pages=128, num_ctx=1024)


@pytest.fixture(scope="module")
def cache(engine):
    return MaskCache(Vocab.from_tokenizer(engine.tokenizer.tok, engine.model.args.vocab_size))


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


def test_trie_walk_finds_exactly_the_accepted_tokens():
    rng = random.Random(0)
    words = sorted(
        {bytes(rng.choice(b"abc") for _ in range(rng.randint(1, 5))) for _ in range(300)}
    )
    items = [(w, i) for i, w in enumerate(words)] + [(words[0], 999)]  # two ids, same bytes

    def advance(last: int, b: int) -> int | None:
        """Words over {a, b} without "bb"; the state is the last byte (1 at the start)."""
        return None if b == ord("c") or (b == last == ord("b")) else b

    out: list[int] = []
    visited = Trie(items).walk(1, advance, out)
    want = [i for w, i in items if b"c" not in w and b"bb" not in w]
    assert sorted(out) == sorted(want)
    assert visited < sum(len(w) for w in words)  # rejected prefixes were skipped whole


def tricky_vocab() -> Vocab:
    """Every single byte, and tokens that cross JSON structure and UTF-8 characters."""
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


def brute_force(gm: GrammarMasks, state) -> torch.Tensor:
    m, v = gm.matcher, gm.vocab
    return torch.tensor([bool(b) and bool(m.feed(state, b)) for b in v.bytes])


@pytest.mark.parametrize(
    "grammar",
    [
        format_grammar(SCHEMA),
        format_grammar("json"),
        Grammar(ANY_OBJECT),
        format_grammar(
            {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}}
        ),
        tool_call_grammar(TOOLS, None, "<tool_call>", "</tool_call>"),
    ],
    ids=["schema", "json", "any", "strings", "tools"],
)
def test_masks_equal_brute_force_along_random_walks(grammar):
    gm = GrammarMasks(grammar, tricky_vocab())
    m, rng = gm.matcher, random.Random(1)
    for _ in range(6):
        state = m.initial()
        for _ in range(60):
            mask = torch.from_numpy(gm.mask(state))
            assert torch.equal(mask, brute_force(gm, state))
            allowed = mask.nonzero().flatten().tolist()
            if not allowed:
                assert m.is_final(state)
                break
            state = m.feed(state, gm.vocab.bytes[rng.choice(allowed)])
            assert state  # an allowed token never breaks the prefix


@pytest.mark.parametrize(
    "schema, prefix",
    [
        ({"type": "string"}, b'"a\\'),
        ({"type": "string", "maxLength": 3}, b'"ab\\'),
        ("json", b'{"k\\'),
        ("json", b'{"k": "\\u00'),
        ({"type": "string"}, b'"\xe6'),
        ({"type": "string"}, b'"\xe6\x97'),
        ({"type": "string"}, b'"\xed'),
        ({"type": "array", "items": {"type": "string", "minLength": 2}}, b'["a'),
    ],
)
def test_masks_equal_brute_force_inside_strings(schema, prefix):
    gm = GrammarMasks(format_grammar(schema), tricky_vocab())
    state = gm.matcher.feed(gm.matcher.initial(), prefix)
    assert state
    assert torch.equal(torch.from_numpy(gm.mask(state)), brute_force(gm, state))


def test_masks_cache_by_state():
    gm = GrammarMasks(format_grammar({"type": "string"}), tricky_vocab())
    state = gm.matcher.feed(gm.matcher.initial(), b'"ab')
    first = gm.mask(state)
    walked = gm.walked
    again = gm.mask(gm.matcher.feed(state, b"cd"))  # the same state inside the string
    assert gm.walked == walked and (first == again).all()


def test_constraint_waits_for_the_end_of_thinking():
    v = tricky_vocab()  # ids 0..255 are the single bytes
    gm = GrammarMasks(format_grammar("json"), v)
    c = Constraint(gm, frozenset({v.size - 1}), thinking=True, think_close=b"</think>")
    for b in b"hmm, {not json} </think":
        assert c.mask() is None
        c.advance(b)
    c.advance(ord(">"))
    for b in b"\n\n":  # whitespace before the answer
        assert c.mask() is not None
        c.advance(b)
    mask = c.mask()
    assert bool(mask[ord("{")]) and not bool(mask[ord("a")]) and not bool(mask[v.size - 1])


def test_constraint_lets_the_first_token_open_thinking():
    v = Vocab([b"{", b"}", b"<think>", b"</think>", b"x", b""], 6)
    gm = GrammarMasks(format_grammar("json"), v)
    c = Constraint(gm, frozenset({5}), think_close=b"</think>", think_open_ids=frozenset({2}))
    assert c.mask().tolist() == [True, False, True, False, False, False]
    c.advance(2)
    assert c.mask() is None  # thinking: free
    c.advance(4)
    c.advance(3)
    assert c.mask().tolist() == [True, False, False, False, False, False]  # no second <think>
    c.advance(0)
    c.advance(1)
    assert c.finished


# -- the engine --------------------------------------------------------------------------------


def run(engine, prompt, params, constraint=None, top_logprobs=None):
    seq = Sequence(list(prompt), params, 400, engine.tokenizer.eos_ids)
    seq.constraint = constraint
    seq.top_logprobs = top_logprobs
    engine.submit(seq, lambda *_: None)
    while not seq.is_finished:
        engine.step()
    return seq


def chat_prompt(engine, text="hi"):
    return engine.tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_random_model_writes_valid_json_for_a_schema(engine, cache, temperature):
    masks = cache.get(["format", SCHEMA], lambda: format_grammar(SCHEMA))
    for seed in range(4):
        p = SamplingParams(temperature=temperature, seed=seed, top_k=0 if seed % 2 else 40)
        seq = run(
            engine,
            chat_prompt(engine, f"person {seed}"),
            p,
            Constraint(masks, engine.tokenizer.eos_ids),
        )
        text = engine.tokenizer.decode(seq.output_ids)
        assert seq.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_format_json_gives_an_object(engine, cache):
    # A random model at temperature 0.9 wanders: some walks close the object within the
    # budget and some do not, and which ones do shifts with floating-point summation order.
    # So judge several walks: every one is an object from its first character, every one
    # that stopped parses as an object, and most stop.
    masks = cache.get(["format", "json"], lambda: format_grammar("json"))
    stopped = 0
    for seed in range(6):
        seq = run(
            engine,
            chat_prompt(engine),
            SamplingParams(temperature=0.9, seed=seed),
            Constraint(masks, engine.tokenizer.eos_ids),
        )
        text = engine.tokenizer.decode(seq.output_ids)
        assert text.lstrip().startswith("{"), text
        if seq.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(text), dict), text
    assert stopped >= 3


@pytest.mark.parametrize("name", [None, "add"])
def test_forced_tool_call_parses_and_validates(engine, cache, name):
    style = QwenFormat(think_open=None, think_close=None)
    masks = cache.get(
        ["call", TOOLS, name],
        lambda: tool_call_grammar(TOOLS, name, style.call_open, style.call_close),
    )
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        seq = run(
            engine,
            chat_prompt(engine, "weather?"),
            SamplingParams(temperature=1.0, seed=seed),
            Constraint(masks, engine.tokenizer.eos_ids),
        )
        parser = OutputParser(style, tools=True)
        events = parser.feed(engine.tokenizer.decode(seq.output_ids)) + parser.finish()
        calls = [c for e in events for c in e.get("tool_calls", [])]
        assert len(calls) == 1 and not [e for e in events if e.get("content", "").strip()], events
        fn = calls[0]["function"]
        assert fn["name"] == (name or fn["name"]) and fn["name"] in params
        jsonschema.validate(fn["arguments"], params[fn["name"]])


def test_the_grammar_applies_once_thinking_ends(engine, cache, monkeypatch):
    tok = engine.tokenizer
    close = tok.tok.token_to_id("</think>")
    logits = engine.model.logits

    def eager_to_stop_thinking(hidden):
        out = logits(hidden)
        out[:, close] += 6.0  # so the random model ends its thinking soon
        return out

    monkeypatch.setattr(engine.model, "logits", eager_to_stop_thinking)
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    masks = cache.get(["format", SCHEMA], lambda: format_grammar(SCHEMA))
    for seed in range(3):
        c = Constraint(masks, tok.eos_ids, thinking=True, think_close=b"</think>")
        seq = run(engine, prompt, SamplingParams(temperature=1.0, seed=seed), c)
        parser = OutputParser(QwenFormat(), thinking=True)
        events = parser.feed(tok.decode(seq.output_ids)) + parser.finish()
        assert seq.finish_reason == "stop" and close in seq.output_ids
        answer = "".join(e.get("content", "") for e in events)
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_unconstrained_sequences_are_untouched(engine, cache):
    prompt = chat_prompt(engine)
    free = run(engine, prompt, SamplingParams(temperature=0.0, num_predict=20))
    masks = cache.get(["format", "json"], lambda: format_grammar("json"))
    seq = Sequence(list(prompt), SamplingParams(temperature=0.0), 30, engine.tokenizer.eos_ids)
    seq.constraint = Constraint(masks, engine.tokenizer.eos_ids)
    together = Sequence(
        list(prompt), SamplingParams(temperature=0.0), 400, engine.tokenizer.eos_ids
    )
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
