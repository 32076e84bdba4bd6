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
