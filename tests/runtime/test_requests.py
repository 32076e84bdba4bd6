"""The model's chat format at work when a request is built: its parser, its forced-call
grammar (or none), its template variables, the control tokens its requests decode."""

from __future__ import annotations

import pytest

from freetoken.chat import formats
from freetoken.protocol import CompletionRequest
from freetoken.runtime.constrain import Grammars
from freetoken.runtime.masks import Masker
from freetoken.runtime.prompt import PromptBuilder
from freetoken.runtime.requests import RequestBuilder, RequestError
from freetoken.runtime.tokenizer import Tokenizer
from freetoken.runtime.vocab import Vocab
from freetoken.tools import synth

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_day",
            "parameters": {
                "type": "object",
                "properties": {"day": {"enum": ["mon", "tue"]}},
                "required": ["day"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "which day?"}]
# the think setting and the tools, as the template saw them
SHOW = (
    "{{ tools | length if tools else 0 }}|{{ enable_thinking | default('-') }}|"
    "{{ thinking | default('-') }}|{{ reasoning_effort | default('-') }}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    tok = synth.train_tokenizer(512)
    tok.add_special_tokens(["<|channel|>", "<|message|>", "<|start|>"])
    tok.save(str(out / "tokenizer.json"))
    return Tokenizer({"tokenizer.json": out / "tokenizer.json"})


def builder(tokenizer: Tokenizer, architecture: str | None) -> RequestBuilder:
    vocab = Vocab.from_tokenizer(tokenizer.tok, tokenizer.vocab_size, formats.MARKERS)
    grammars = Grammars(vocab, tokenizer.eos_ids)
    return RequestBuilder(tokenizer, PromptBuilder(tokenizer, SHOW), grammars, 512, architecture)


def chat(**kw) -> CompletionRequest:
    return CompletionRequest(kind="chat", messages=ASK, **kw)


def test_the_architecture_chooses_the_parser(tokenizer):
    out = "<tool_call>get_day\n<arg_key>day</arg_key>\n<arg_value>mon</arg_value>\n</tool_call>"
    parser = builder(tokenizer, "glm4_moe").prepare(chat(tools=TOOLS)).parser
    events = parser.feed(out) + parser.finish()
    assert events == [
        {"tool_calls": [{"function": {"name": "get_day", "arguments": {"day": "mon"}}}]}
    ]
    # a model no architecture claims: the template (which shows no markers) says Qwen's
    qwen = builder(tokenizer, "qwen3_moe").prepare(chat(tools=TOOLS)).parser
    assert qwen.feed(out) + qwen.finish() == [{"content": out}]


@pytest.mark.parametrize(
    "architecture", ["deepseek_v3", "mixtral", "gpt_oss", "qwen3_moe", "glm4_moe", "minimax_m2"]
)
def test_calls_are_constrained_in_every_format(tokenizer, architecture):
    choice = {"type": "function", "function": {"name": "get_day"}}
    prepared = builder(tokenizer, architecture).prepare(chat(tools=TOOLS, tool_choice=choice))
    assert prepared.seq.constraint.matcher is not None
    # under auto, the calls the model opens are constrained too, where a marker opens them
    # (this template shows none of Qwen's: its calls would be bare JSON, nothing to wait for)
    auto = builder(tokenizer, architecture).prepare(chat(tools=TOOLS, think=False))
    assert (auto.seq.constraint is not None) == (architecture != "qwen3_moe")
    with pytest.raises(RequestError, match="not among the tools"):
        builder(tokenizer, architecture).prepare(
            chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
        )


def test_a_harmony_grammar_may_write_its_control_tokens(tokenizer):
    choice = {"type": "function", "function": {"name": "get_day"}}
    prepared = builder(tokenizer, "gpt_oss").prepare(chat(tools=TOOLS, tool_choice=choice))
    mask = Masker().compute([prepared.seq.constraint])[0]
    assert tokenizer.tok.token_to_id("<|channel|>") in mask.allowed()
    assert prepared.seq.shown_ids == tokenizer.special_ids(
        ["<|channel|>", "<|message|>", "<|start|>"]
    )
    assert builder(tokenizer, "qwen3_moe").prepare(chat()).seq.shown_ids == tokenizer.special_ids(
        formats.QwenFormat.markers
    )


@pytest.mark.parametrize(
    "architecture, think, shown",
    [
        ("qwen3_moe", None, "1|True|-|-"),  # on where the template takes it
        ("qwen3_moe", "low", "1|True|-|low"),
        ("deepseek_v3", True, "1|True|True|-"),
        ("deepseek_v3", False, "1|False|False|-"),
        ("gpt_oss", "max", "1|True|-|high"),
    ],
)
def test_the_think_setting_reaches_the_template_as_the_format_names_it(
    tokenizer, architecture, think, shown
):
    b = builder(tokenizer, architecture)
    prepared = b.prepare(chat(tools=TOOLS, think=think))
    assert tokenizer.decode(prepared.seq.prompt_ids) == shown
    assert b.count(chat(tools=TOOLS, think=think)) == len(prepared.seq.prompt_ids)


def test_a_thinking_budget_bounds_the_thinking(tokenizer):
    b = builder(tokenizer, "qwen3_moe")
    assert b.prepare(chat(think="low")).seq.constraint is None  # the server sets budgets
    assert b.prepare(chat(think=True, think_budget=9)).seq.constraint.think.budget == 9
    # Harmony: its analysis messages are the thinking, the grammar writes them
    harmony = builder(tokenizer, "gpt_oss").prepare(chat(think_budget=5)).seq.constraint
    assert harmony.think.budget == 5 and harmony.think.anywhere and harmony.grammar_thinks
