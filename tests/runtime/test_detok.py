from __future__ import annotations

import random

from freetoken.runtime.detok import Detokenizer, StopMatcher
from freetoken.tools import synth


def _tok():
    return synth.train_tokenizer(512)


def test_streamed_text_equals_full_decode_and_is_never_broken():
    tok = _tok()
    text = "Hello café naïve — 日本語 🙂 done"
    ids = tok.encode(text).ids
    d = Detokenizer(lambda x: tok.decode(list(x), skip_special_tokens=False))
    pieces = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False)
    assert all("\ufffd" not in p for p in pieces)


def test_random_token_streams_join_to_the_full_decode():
    tok = _tok()
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(40)]
        d = Detokenizer(lambda x: tok.decode(list(x), skip_special_tokens=False))
        out = "".join(d.push(i) for i in ids) + d.flush()
        assert out == tok.decode(ids, skip_special_tokens=False)
        out.encode("utf-8")  # always valid UTF-8


def test_stop_string_split_across_pushes_is_not_leaked():
    m = StopMatcher(["<|stop|>", "END"])
    emitted = []
    stopped = False
    for piece in ["Hello <", "|st", "op", "|> after"]:
        text, stopped = m.push(piece)
        emitted.append(text)
        if stopped:
            break
    assert stopped
    assert "".join(emitted) == "Hello "


def test_partial_stop_prefix_is_released_when_it_diverges():
    m = StopMatcher(["END"])
    assert m.push("the EN") == ("the ", False)
    assert m.push("D") == ("", True)
    m2 = StopMatcher(["END"])
    assert m2.push("EN") == ("", False)
    assert m2.push("x") == ("ENx", False)
    assert m2.flush() == ""


def test_earliest_stop_wins():
    m = StopMatcher(["bb", "a"])
    assert m.push("xxbba") == ("xx", True)
