"""Each family's tool-call and reasoning format through the real server: a model of the
family's architecture (Harmony's: a template that shows it) whose weights make it write the
family's markup (tests/api/scripted.py), served with a template written for the test in the
family's prompt shape. Calls come back structured on /api/chat, /v1/chat/completions and
/v1/messages, thinking as thinking or reasoning, and no markup in content.

Also: think levels reach a Jinja template that prints the level."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from freetoken.chat import formats
from freetoken.store import CreateSpec, Store
from freetoken.tools import synth
from tests.api import templates
from tests.api.scripted import script_model
from tests.fixtures import SYNTH_TINY
from tests.server.harness import LiveServer, make_config

WEATHER_ARGS, TIME_ARGS = {"city": "Paris", "days": 3}, {"zone": "Asia/Tokyo", "n": [1, 2]}
PARAMS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
    "get_time": {
        "type": "object",
        "properties": {"zone": {"type": "string"}, "n": {"type": "array"}},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": n, "parameters": p}}
    for n, p in PARAMS.items()
]
ASK = [{"role": "user", "content": "The weather in Paris and the time in Tokyo?"}]
BOTH = [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]


@dataclass
class Family:
    build: Callable[[pytest.TempPathFactory], Path]
    template: str
    chain: list[str]  # the prompt's last token, then what the model writes
    special: tuple[str, ...]  # pieces that are control tokens
    thinking: str
    content: str
    calls: list[tuple[str, dict[str, Any]]]
    eos: str = "<|im_end|>"


def _qwen(f: pytest.TempPathFactory) -> Path:
    return synth.write_qwen3_moe(f.mktemp("qwen") / "m", **SYNTH_TINY)


def _deepseek(f: pytest.TempPathFactory) -> Path:
    from tests.models import test_deepseek_v3 as m

    return m._build(f, "fmt-ds3", m.PLAIN, 81)[0]


def _glm(f: pytest.TempPathFactory) -> Path:
    from tests.models import test_glm4_moe as m

    return m._build(f, "fmt-glm", 82)[0]


def _minimax(f: pytest.TempPathFactory) -> Path:
    from tests.models import test_minimax_m2 as m

    return m._build(f, "fmt-minimax", 83)[0]


def _deepseek_v4(f: pytest.TempPathFactory) -> Path:
    from tests.models import test_deepseek_v4 as m

    return m._build(f, "fmt-ds4", m.MIXED, 85, original_format=False)[0]


def _mixtral(f: pytest.TempPathFactory) -> Path:
    from tests.models import test_mixtral as m

    return m._build(f, "fmt-mixtral", m.CONFIG, 84)[0]


def _granite(f: pytest.TempPathFactory) -> Path:
    from tests.models import test_granitemoe as m

    # an output head of its own, as the script needs
    return m._build(f, "fmt-granite", {**m.CONFIG, "tie_word_embeddings": False}, 86)[0]


DS_BEGIN, DS_CALL, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_END, DS_CLOSE = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"

FAMILIES = {
    "deepseek": Family(
        _deepseek,
        templates.DEEPSEEK,
        ["<｜Assistant｜>", "<think>", "Two cities to check.", "</think>", "Let me check."]
        + [DS_BEGIN, DS_CALL, "function", DS_SEP]
        + ['get_weather\n```json\n{"city": "Paris", "days": 3}\n```', DS_END]
        + [
            f"{DS_CALL}function{DS_SEP}get_time\n```json\n"
            f'{{"zone": "Asia/Tokyo", "n": [1, 2]}}\n```{DS_END}',
            DS_CLOSE,
        ],
        ("<｜Assistant｜>", DS_BEGIN, DS_CALL, DS_SEP, DS_END, DS_CLOSE),
        "Two cities to check.",
        "Let me check.",
        BOTH,
    ),
    "dsml": Family(
        _deepseek_v4,
        templates.DSML,
        ["<｜Assistant｜>", "<think>", "Two cities to check.", "</think>", "Let me check."]
        + ["<｜DSML｜tool_calls>", '\n<｜DSML｜invoke name="get_weather">\n']
        + ['<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n']
        + ['<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n']
        + ['</｜DSML｜invoke>\n<｜DSML｜invoke name="get_time">\n']
        + ['<｜DSML｜parameter name="zone" string="true">Asia/Tokyo</｜DSML｜parameter>\n']
        + ['<｜DSML｜parameter name="n" string="false">[1, 2]</｜DSML｜parameter>\n']
        + ["</｜DSML｜invoke>\n", "</｜DSML｜tool_calls>"],
        ("<｜Assistant｜>", "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"),
        "Two cities to check.",
        "Let me check.",
        BOTH,
    ),
    "glm": Family(
        _glm,
        templates.GLM,
        ["<|assistant|>", "<think>", "Two cities to check.", "</think>", "Let me check."]
        + ["<tool_call>", "get_weather\n", "<arg_key>", "city", "</arg_key>", "<arg_value>"]
        + ["Paris", "</arg_value>", "\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"]
        + [
            "</tool_call>",
            "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>Asia/Tokyo</arg_value>"
            "\n<arg_key>n</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>",
        ],
        ("<|assistant|>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        "Two cities to check.",
        "Let me check.",
        BOTH,
    ),
    "minimax": Family(
        _minimax,
        templates.MINIMAX,
        ["\n", "Two cities to check.", "</think>", "\n\nLet me check.", "<minimax:tool_call>"]
        + [
            '\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
            '<parameter name="days">3</parameter>\n</invoke>',
            '\n<invoke name="get_time">\n<parameter name="zone">Asia/Tokyo</parameter>\n'
            '<parameter name="n">[1, 2]</parameter>\n</invoke>\n',
            "</minimax:tool_call>",
        ],
        ("<minimax:tool_call>", "</minimax:tool_call>"),
        "Two cities to check.",
        "Let me check.",
        BOTH,
    ),
    "mistral": Family(
        _mixtral,
        templates.MISTRAL,
        ["[/INST]", "Let me check.", "[TOOL_CALLS]", "get_weather", "[ARGS]"]
        + ['{"city": "Paris", "days": 3}']
        + ['[TOOL_CALLS]get_time[ARGS]{"zone": "Asia/Tokyo", "n": [1, 2]}'],
        ("[/INST]", "[TOOL_CALLS]", "[ARGS]"),
        "",
        "Let me check.",
        BOTH,
    ),
    "granite": Family(
        _granite,
        templates.GRANITE,
        ["<|end_of_role|>", "Let me check.", "<|tool_call|>"]
        + ['[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, ']
        + ['{"name": "get_time", "arguments": {"zone": "Asia/Tokyo", "n": [1, 2]}}]'],
        ("<|end_of_role|>", "<|tool_call|>"),
        "",
        "Let me check.",
        BOTH,
        eos="<|end_of_text|>",
    ),
    "harmony": Family(
        _qwen,
        templates.HARMONY,
        ["assistant", "<|channel|>", "analysis", "<|message|>", "Need the weather."]
        + ["<|end|>", "<|start|>"]
        + [
            "assistant<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.get_weather ",
            "<|constrain|>",
            "json<|message|>",
            '{"city": "Paris", "days": 3}',
        ],
        ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>"),
        "Need the weather.",
        "Let me check.",
        BOTH[:1],  # <|call|> ends the output: one call a turn
        eos="<|call|>",
    ),
}

# the levels model: the template's last token names the think setting it was given
LEVELS = ["low", "medium", "high", "on", "off", "unset"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("format-models")
    store = Store(root)
    for name, fam in FAMILIES.items():
        path = fam.build(tmp_path_factory)
        script_model(path, [fam.chain], special=fam.special, eos=fam.eos)
        for _ in store.plan_create(CreateSpec(name, from_=str(path), template=fam.template)).run():
            pass
    path = _qwen(tmp_path_factory)
    chains = [[f"<effort_{x}>", f"effort {x}"] for x in LEVELS]
    script_model(path, chains, special=[c[0] for c in chains])
    for _ in store.plan_create(
        CreateSpec("levels", from_=str(path), template=templates.LEVELS)
    ).run():
        pass
    with LiveServer(make_config(root)) as srv:
        yield srv


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, Family]:
    """Module-scoped, so the tests run family by family and each model loads once."""
    return request.param, FAMILIES[request.param]


def _no_markup(*texts: str | None) -> None:
    for text in texts:
        for marker in formats.MARKERS:
            assert marker not in (text or ""), f"{marker!r} in {text!r}"


def _calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, dict(c.function.arguments)) for c in calls or []]


def test_api_chat(server, family):
    name, fam = family
    client = ollama.Client(host=server.url)
    opts = {"temperature": 0, "num_predict": 64}
    r = client.chat(name, messages=ASK, tools=TOOLS, options=opts)
    assert (r.message.thinking or "", r.message.content) == (fam.thinking, fam.content)
    assert _calls(r.message.tool_calls) == fam.calls
    chunks = list(client.chat(name, messages=ASK, tools=TOOLS, options=opts, stream=True))
    for c in chunks:
        _no_markup(c.message.content, c.message.thinking)
    assert "".join(c.message.content for c in chunks) == fam.content
    assert "".join(c.message.thinking or "" for c in chunks) == fam.thinking
    kinds = [k for c in chunks for k in ("content", "tool_calls") if getattr(c.message, k)]
    assert kinds.index("content") < kinds.index("tool_calls")  # content before a call streams
    assert [x for c in chunks for x in _calls(c.message.tool_calls)] == fam.calls


def _openai_calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


def test_openai_chat_completions(server, family):
    name, fam = family
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="ollama", max_retries=0)
    kw = dict(model=name, messages=ASK, tools=TOOLS, temperature=0, max_tokens=64)
    whole = oai.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == fam.content
    assert (whole.message.model_extra or {}).get("reasoning", "") == fam.thinking
    assert _openai_calls(whole.message.tool_calls) == fam.calls
    with oai.chat.completions.stream(**kw) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    deltas = [ch.delta for c in chunks for ch in c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning", "") for d in deltas)
    _no_markup(*(d.content for d in deltas), reasoning)
    assert (reasoning, final.message.content) == (fam.thinking, fam.content)
    assert _openai_calls(final.message.tool_calls) == fam.calls


def test_anthropic_messages(server, family):
    name, fam = family
    claude = anthropic.Anthropic(base_url=server.url, api_key="sk-ignored", max_retries=0)
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    kw = dict(model=name, messages=ASK, tools=tools, max_tokens=64)
    for message in (claude.messages.create(**kw), _streamed(claude, kw)):
        blocks = {b.type: [] for b in message.content}
        for b in message.content:
            blocks[b.type].append(b)
        assert [b.thinking for b in blocks.get("thinking", [])] == (
            [fam.thinking] if fam.thinking else []
        )
        assert [b.text for b in blocks.get("text", [])] == [fam.content]
        assert [(b.name, b.input) for b in blocks["tool_use"]] == fam.calls
        assert message.stop_reason == "tool_use"


def _streamed(claude: anthropic.Anthropic, kw: dict[str, Any]) -> Any:
    with claude.messages.stream(**kw) as stream:
        return stream.get_final_message()


DAY = {
    "type": "function",
    "function": {
        "name": "get_day",
        "description": "a day",
        "parameters": {
            "type": "object",
            "properties": {"day": {"enum": ["mon", "tue"]}},
            "required": ["day"],
            "additionalProperties": False,
        },
    },
}


def test_a_forced_call_is_written_in_the_familys_markup(server, family):
    """The random model is held to one call in the family's markup, which its parser reads
    back (GLM's and MiniMax-M2's too: their bare-text values are lazy lexemes). Harmony's
    grammar lets analysis messages come first, and this model's script starts one whenever
    it may: with thinking off, the grammar holds none."""
    name, fam = family
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="ollama", max_retries=0)
    choice = {"type": "function", "function": {"name": "get_day"}}
    extra = {"reasoning_effort": "none"} if name == "harmony" else {}
    # one tool: the tiny models' context is 512 tokens
    out = oai.chat.completions.create(
        model=name, messages=ASK, tools=[DAY], tool_choice=choice, max_tokens=400, **extra
    ).choices[0]
    assert out.finish_reason == "tool_calls"
    _no_markup(out.message.content, (out.message.model_extra or {}).get("reasoning"))
    got = _openai_calls(out.message.tool_calls)
    assert [n for n, _ in got] == ["get_day"] and got[0][1]["day"] in ("mon", "tue")


@pytest.mark.parametrize(
    "route, body, want",
    [
        ("/api/chat", {"think": "high"}, "high"),
        ("/api/chat", {"think": "max"}, "high"),
        ("/api/chat", {"think": False}, "off"),
        ("/api/chat", {}, "on"),  # thinking is on by default where the template takes it
        ("/v1/chat/completions", {"reasoning_effort": "low"}, "low"),
        ("/v1/chat/completions", {"reasoning_effort": "none"}, "off"),
        ("/v1/chat/completions", {"reasoning_effort": "minimal"}, "low"),
        ("/v1/responses", {"reasoning": {"effort": "medium"}}, "medium"),
    ],
)
def test_think_levels_reach_the_template(server, route, body, want):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        payload = {"model": "levels", "stream": False, **body}
        key = "input" if route == "/v1/responses" else "messages"
        payload[key] = ASK
        r = http.post(route, json=payload)
        assert r.status_code == 200, r.text
        out = r.json()
    text = {
        "/api/chat": lambda: out["message"]["content"],
        "/v1/chat/completions": lambda: out["choices"][0]["message"]["content"],
        "/v1/responses": lambda: out["output"][-1]["content"][0]["text"],
    }[route]()
    assert text == f"effort {want}"


def test_a_level_that_is_not_one_is_refused(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/api/chat", json={"model": "levels", "messages": ASK, "think": "huge"})
    assert r.status_code == 400 and "invalid think value" in r.json()["error"]
