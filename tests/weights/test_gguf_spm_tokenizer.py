"""A SentencePiece GGUF's tokenizer (`tokenizer.ggml.model = llama`: Mixtral, ERNIE-4.5),
rebuilt from its pieces and scores alone, tokenizes as SentencePiece itself does: the same
ids for the same text and the same text back, unknown characters through byte pieces; added
tokens are matched whole, the text after each given a space prefix as llama.cpp gives it.

The reference is a SentencePiece BPE model trained here on Python's own documentation and
written to GGUF as llama.cpp's converter writes one (pieces, scores, token types)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from freetoken.runtime.tokenizer import Tokenizer
from freetoken.weights.gguf_tokenizer import spm_merges, write_tokenizer_files

spm = pytest.importorskip("sentencepiece")

PROMPTS = [
    "Why is the sky blue?",
    "Hello! How are you?   Numbers 12345 and 3.14159, naïve café, 日本語 🙂",
    "  leading spaces\n\n\ttabs\r\nand newlines'll we've",
    "def f(x):\n    return x ** 2  # squares",
    "",
]
ADDED = "<tool_call>"


def _text() -> list[str]:
    import collections
    import json
    import os
    import re

    docs = [m.__doc__ or "" for m in (os, re, json, collections, io, Path)]
    return [line for doc in docs for line in doc.splitlines() if line.strip()] * 3


@pytest.fixture(scope="module")
def model():
    """A trained SentencePiece BPE model with byte fallback and one user-defined piece, its
    text unnormalized as Llama's and Mistral's are (llama.cpp normalizes nothing)."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_text()),
        model_writer=proto,
        model_type="bpe",
        vocab_size=600,
        byte_fallback=True,
        character_coverage=0.995,
        user_defined_symbols=[ADDED],
        # as Llama's and Mistral's models are trained: text kept as it is
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=proto.getvalue())


def _type(sp, i: int) -> int:
    """llama.cpp's token type for a piece (its converter's mapping)."""
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_unused(i):
        return 5
    if sp.is_byte(i):
        return 6
    return 4 if sp.id_to_piece(i) == ADDED else 1


def write_gguf(sp, out: Path) -> Path:
    import gguf

    n = sp.get_piece_size()
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([_type(sp, i) for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def rebuilt(model, tmp_path_factory) -> Tokenizer:
    work = tmp_path_factory.mktemp("spm")
    out = work / "tok"
    write_tokenizer_files(write_gguf(model, work / "m.gguf"), out)
    return Tokenizer({p.name: p for p in out.iterdir()})


def test_text_tokenizes_as_sentencepiece_does(model, rebuilt):
    assert rebuilt.add_bos and rebuilt.bos_token == "<s>"
    for prompt in PROMPTS:
        want = [model.bos_id(), *model.encode(prompt)]
        assert rebuilt.encode(prompt) == want, prompt
        assert rebuilt.decode(want[1:]) == model.decode(want[1:]), prompt
    # a character the model never saw comes out as its UTF-8 bytes' pieces
    ids = rebuilt.encode("ǂ")
    assert [model.id_to_piece(i) for i in ids[2:]] == ["<0xC7>", "<0x82>"]


def test_added_tokens_are_matched_whole_and_text_after_them_gets_a_space(model, rebuilt):
    """llama.cpp's rule for SentencePiece files: each run of text between added tokens is
    tokenized alone, with the space prefix."""
    ids = rebuilt.encode(f"call{ADDED}now</s>done")
    want = [model.bos_id(), *model.encode("call"), model.piece_to_id(ADDED), *model.encode("now")]
    assert ids == [*want, model.eos_id(), *model.encode("done")]


def test_merges_follow_the_scores():
    """Pieces joinable two ways give both merges, the best-scored piece's first; bytes and
    control pieces are never made by a merge."""
    tokens = ["<s>", "<0x41>", "a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
    types = [3, 6, 1, 1, 1, 1, 1, 1]
    assert spm_merges(tokens, scores, types) == [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]
