"""Control tokens a chat format reads decode as text; the others stay hidden."""

from __future__ import annotations

import pytest

from freetoken.chat.grammar import Grammar
from freetoken.runtime.constrain import Constraint, Grammars
from freetoken.runtime.detok import Detokenizer
from freetoken.runtime.masks import Masker
from freetoken.runtime.tokenizer import Tokenizer
from freetoken.runtime.vocab import Vocab, token_bytes
from freetoken.tools import synth


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    tok = synth.train_tokenizer(512)
    tok.add_special_tokens(["<|channel|>", "<|hidden|>", "<｜tool▁sep｜>"])
    tok.save(str(out / "tokenizer.json"))
    return {"tokenizer.json": out / "tokenizer.json"}


def test_shown_control_tokens_decode_as_text(files):
    tok = Tokenizer(files)
    ids = tok.encode("<|hidden|>a<|channel|>final<|hidden|> b")
    assert tok.decode(ids) == "afinal b"
    shown = tok.special_ids(["<|channel|>"])
    assert tok.decode(ids, shown=shown) == "a<|channel|>final b"
    d = Detokenizer(lambda x: tok.decode(x, shown=shown))
    assert "".join(d.push(i) for i in ids) + d.flush() == "a<|channel|>final b"
    wide = tok.encode("é<｜tool▁sep｜>ü<|hidden|>")
    assert tok.decode(wide, shown=tok.special_ids(["<｜tool▁sep｜>"])) == "é<｜tool▁sep｜>ü"


def test_marker_tokens_are_text_to_grammars_and_other_control_tokens_are_not(files):
    tok = Tokenizer(files).tok
    channel, hidden = tok.token_to_id("<|channel|>"), tok.token_to_id("<|hidden|>")
    assert token_bytes(tok)[channel] == b""
    assert token_bytes(tok, ["<|channel|>"])[channel] == b"<|channel|>"
    vocab = Vocab.from_tokenizer(tok, tok.get_vocab_size(), ["<|channel|>"])
    assert vocab.bytes[channel] == b"<|channel|>" and vocab.bytes[hidden] == b""
    # free text: a marker may be written (a grammar writes markers as text), a hidden
    # control token never
    grammars = Grammars(vocab, [tok.token_to_id("<|im_end|>")])
    free = Grammar("start: /(.|\\n)*/\n")
    c = Constraint(grammars.matcher(free), vocab, [], grammars.eos_ids)
    on = set(Masker().compute([c])[0].allowed().tolist())
    assert channel in on and hidden not in on and tok.token_to_id("a") in on
    assert len(on) > 400
