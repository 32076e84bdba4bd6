from __future__ import annotations

import pytest

from freetoken.protocol import CompletionRequest
from freetoken.runtime.prompt import PromptBuilder, PromptError
from freetoken.runtime.tokenizer import Tokenizer
from tests.runtime.engine_util import files_of


def build(builder: PromptBuilder, body: dict, num_ctx: int):
    return builder.build(CompletionRequest.from_json(body), num_ctx)


@pytest.fixture(scope="module")
def builder(tiny_model):
    return PromptBuilder(Tokenizer(files_of(tiny_model[0])), None)


def _chat(n):
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(n):
        msgs.append({"role": "user", "content": f"question number {i} about the weather"})
        msgs.append({"role": "assistant", "content": f"answer number {i}"})
    msgs.append({"role": "user", "content": "last question"})
    return msgs


def test_chat_renders_the_template(builder):
    p = build(builder, {"kind": "chat", "messages": _chat(0)}, 512)
    assert p.text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nlast question<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert builder.tokenizer.tok.decode(p.ids, skip_special_tokens=False) == p.text


def test_long_chat_drops_oldest_messages_but_keeps_system_and_last(builder):
    full = build(builder, {"kind": "chat", "messages": _chat(20)}, 100000)
    p = build(builder, {"kind": "chat", "messages": _chat(20)}, len(full.ids) // 2)
    assert len(p.ids) < len(full.ids) // 2
    assert p.text.startswith("<|im_start|>system\nBe brief.")
    assert "last question" in p.text
    assert "question number 0 " not in p.text


def test_truncate_false_is_an_error(builder):
    with pytest.raises(PromptError, match="exceeds the context length"):
        build(builder, {"kind": "chat", "messages": _chat(20), "truncate": False}, 64)


def test_generate_raw_is_verbatim_and_truncates_keeping_num_keep(builder):
    p = build(builder, {"kind": "generate", "prompt": "hello world " * 50, "raw": True}, 100000)
    assert builder.tokenizer.decode(p.ids) == "hello world " * 50
    short = build(
        builder,
        {
            "kind": "generate",
            "prompt": "hello world " * 50,
            "raw": True,
            "options": {"num_keep": 3},
        },
        20,
    )
    assert len(short.ids) == 19 and short.truncated
    assert short.ids[:3] == p.ids[:3] and short.ids[3:] == p.ids[-16:]


def test_generate_with_system_and_context(builder):
    p = build(
        builder, {"kind": "generate", "prompt": "hi", "system": "S", "context": [1, 2, 3]}, 512
    )
    assert p.ids[:3] == [1, 2, 3]
    assert (
        p.text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_images_are_rejected_for_text_models(builder):
    with pytest.raises(PromptError, match="images"):
        build(
            builder,
            {"kind": "chat", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            512,
        )


class _Counting:
    """The tokenizer, counting the characters it is asked to tokenize and the renders."""

    def __init__(self, tokenizer):
        self.inner, self.chars, self.calls = tokenizer, 0, 0
        self.max_token_chars = tokenizer.max_token_chars
        self.chat_template, self.bos_token = tokenizer.chat_template, tokenizer.bos_token
        self.eos_token = tokenizer.eos_token

    def encode(self, text):
        self.chars += len(text)
        self.calls += 1
        return self.inner.encode(text)


def test_work_is_bounded_by_the_context_not_the_request(builder):
    """Issue 22: a 10 MB prompt held a runner for ~17 s. Only what the context can hold is
    tokenized, and the messages to drop are found by bisection."""
    spy = _Counting(builder.tokenizer)
    bounded = PromptBuilder(spy, None)
    num_ctx, limit = 256, 2 * 256 * spy.max_token_chars
    huge = {"kind": "chat", "messages": [{"role": "user", "content": "word " * 2_000_000}]}
    p = build(bounded, huge, num_ctx)
    assert len(p.ids) == num_ctx - 1 and p.truncated
    assert "word word word" in builder.tokenizer.decode(p.ids[-30:])
    assert spy.chars <= limit + 4 * spy.max_token_chars

    many = [{"role": "user", "content": f"message {i} " * 50} for i in range(2000)]
    spy.chars = spy.calls = 0
    p = build(bounded, {"kind": "chat", "messages": many}, num_ctx)
    assert len(p.ids) < num_ctx and "message 1999" in p.text and "message 1997 " not in p.text
    assert spy.calls <= 14 and spy.chars <= 14 * limit  # ~log2(2000) renders, each bounded

    with pytest.raises(PromptError, match="exceeds the context length"):
        build(bounded, {**huge, "truncate": False}, num_ctx)


def _drop_one_at_a_time(builder, messages, num_ctx):
    """The prompt the earlier implementation built: drop the oldest droppable message,
    render and tokenize everything again, until it fits."""
    kept = list(messages)
    req = CompletionRequest.from_json({"kind": "chat", "messages": messages})
    while True:
        ids = builder.tokenizer.encode(builder.render(kept, req))
        droppable = [i for i, m in enumerate(kept[:-1]) if m["role"] != "system"]
        if len(ids) < num_ctx or not droppable:
            return ids
        del kept[droppable[0]]


def test_bisection_drops_what_one_at_a_time_dropped(builder):
    messages = _chat(30)
    full = build(builder, {"kind": "chat", "messages": messages}, 100000)
    for num_ctx in (60, 120, 333, len(full.ids) // 2, len(full.ids) - 5):
        p = build(builder, {"kind": "chat", "messages": messages}, num_ctx)
        want = _drop_one_at_a_time(builder, messages, num_ctx)
        assert p.ids == want[:4] + want[len(want) - (num_ctx - 5) :] if p.truncated else want
