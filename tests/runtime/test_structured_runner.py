"""Structured outputs, tool_choice, logprobs and embeddings through the real runner process."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import jsonschema
import pytest
import torch

from tests.runtime.engine_util import runner_process

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 20},
        "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy"]}, "maxItems": 2},
    },
    "required": ["title", "year"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
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
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def runner(tiny_model, tmp_path_factory):
    with runner_process(
        tiny_model[0], tmp_path_factory.mktemp("structured-runner"), num_ctx=512, timeout=60
    ) as client:
        yield client


def events(client, body):
    with client.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def content(evs) -> str:
    return "".join(e.get("content", "") for e in evs)


def chat(**kw):
    return {
        "kind": "chat",
        "messages": USER,
        **kw,
        "options": {"num_predict": 300, **kw.get("options", {})},
    }


@pytest.mark.parametrize("seed", range(4))
def test_format_schema_gives_valid_json(runner, seed):
    evs = events(runner, chat(format=SCHEMA, options={"seed": seed, "temperature": 1.0}))
    assert evs[-1]["done"] and evs[-1]["done_reason"] == "stop"
    jsonschema.validate(json.loads(content(evs)), SCHEMA)


def test_format_json_on_raw_generate_gives_an_object(runner):
    # A random model may stay inside a free string past the token limit, and which walks
    # close the object shifts with summation order (batching, the prefix cache): so judge
    # several walks, two at a time as the runner batches them. Every walk is compact JSON
    # from its first character (a JSON string holds no raw newline), every one that
    # stopped parses as an object, and some stop.
    def walk(seed):
        body = {"kind": "generate", "prompt": "data:", "raw": True, "format": "json"}
        return events(runner, {**body, "options": {"seed": seed, "num_predict": 400}})

    with cf.ThreadPoolExecutor(2) as ex:
        walks = list(ex.map(walk, range(8)))
    stopped = [content(evs) for evs in walks if evs[-1]["done_reason"] == "stop"]
    for text in map(content, walks):
        assert text.startswith("{") and "\n" not in text and "\t" not in text, text
    assert stopped and all(isinstance(json.loads(text), dict) for text in stopped)


def test_a_formatted_answer_is_content_even_beside_tools(runner):
    schema = {
        "type": "object",
        "properties": {
            "name": {"enum": ["add"]},
            "arguments": {"type": "object", "maxProperties": 0, "additionalProperties": False},
        },
        "required": ["name", "arguments"],
    }
    evs = events(runner, chat(tools=TOOLS, format=schema, options={"seed": 1}))
    assert not tool_calls(evs)
    assert json.loads(content(evs)) == {"name": "add", "arguments": {}}


def tool_calls(evs):
    return [c for e in evs for c in e.get("tool_calls", [])]


def check_call(call, name=None):
    fn = call["function"]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert fn["name"] in params and (name is None or fn["name"] == name)
    jsonschema.validate(fn["arguments"], params[fn["name"]])


@pytest.mark.parametrize("seed", range(3))
def test_tool_choice_required_forces_one_valid_call(runner, seed):
    evs = events(runner, chat(tools=TOOLS, tool_choice="required", options={"seed": seed}))
    calls = tool_calls(evs)
    assert len(calls) == 1 and not content(evs).strip()
    check_call(calls[0])
    assert evs[-1]["done_reason"] == "stop"


def test_tool_choice_names_the_function(runner):
    choice = {"type": "function", "function": {"name": "add"}}
    calls = tool_calls(events(runner, chat(tools=TOOLS, tool_choice=choice, options={"seed": 3})))
    assert len(calls) == 1
    check_call(calls[0], "add")


def test_tool_choice_none_keeps_tools_out_of_the_prompt(runner):
    with_tools = events(runner, chat(tools=TOOLS, options={"num_predict": 1, "temperature": 0}))
    without = events(
        runner, chat(tools=TOOLS, tool_choice="none", options={"num_predict": 1, "temperature": 0})
    )
    plain = events(runner, chat(options={"num_predict": 1, "temperature": 0}))

    def prompt(evs):  # evaluated, and read from the prefix cache
        return evs[-1]["prompt_eval_count"] + evs[-1]["prompt_cached_count"]

    assert prompt(without) == prompt(plain)
    assert prompt(with_tools) > prompt(plain)


def test_tool_choice_option_forces_a_call_until_a_tool_answers(runner):
    forced = events(runner, chat(tools=TOOLS, options={"tool_choice": "required", "seed": 4}))
    assert len(tool_calls(forced)) == 1
    check_call(tool_calls(forced)[0])
    call = tool_calls(forced)[0]
    after = USER + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "22 C", "tool_name": call["function"]["name"]},
    ]
    free = events(
        runner,
        {
            **chat(
                tools=TOOLS,
                options={"tool_choice": "required", "temperature": 0, "num_predict": 20},
            ),
            "messages": after,
        },
    )
    assert not tool_calls(free) and content(free)  # the answer after the tool result is free
    # the request's own field overrides the option
    free = events(
        runner,
        chat(
            tools=TOOLS,
            tool_choice="auto",
            options={"tool_choice": "required", "temperature": 0, "num_predict": 20},
        ),
    )
    assert not tool_calls(free)


@pytest.mark.parametrize(
    "body, message",
    [
        (chat(format={"type": "nope"}), "Invalid type: nope"),
        (chat(format={"type": "array", "uniqueItems": True}), "keyword uniqueItems"),
        (
            chat(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}]
                + TOOLS,
                tool_choice="required",
            ),
            'tool "f": schema keyword not',
        ),
        (chat(tool_choice="required"), "tool_choice needs tools"),
        (
            chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "not among the tools",
        ),
        (chat(tools=TOOLS, tool_choice="sometimes"), "invalid tool_choice"),
        (chat(tools=TOOLS, options={"tool_choice": "always"}), "invalid tool_choice option"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs must be between 0 and 20"),
        ({"kind": "generate", "prompt": "x", "images": ["aGk="]}, "does not support images"),
    ],
)
def test_refusals(runner, body, message):
    r = runner.post("/completion", json=body)
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_logprobs_ride_on_the_events(runner):
    evs = events(
        runner, chat(logprobs=True, top_logprobs=2, options={"num_predict": 8, "temperature": 0})
    )
    lps = [lp for e in evs for lp in e.get("logprobs", [])]
    assert len(lps) == evs[-1]["eval_count"] == 8
    text = "".join(lp["token"] for lp in lps)
    assert text == content(evs)
    for lp in lps:
        assert lp["logprob"] <= 0 and bytes(lp["bytes"]).decode("utf-8", "replace") == lp["token"]
        assert len(lp["top_logprobs"]) == 2 and lp["top_logprobs"][0]["token"] == lp["token"]
    evs = events(runner, chat(logprobs=True, options={"num_predict": 3}))
    assert all("top_logprobs" not in lp for e in evs for lp in e.get("logprobs", []))
    assert not any("logprobs" in e for e in events(runner, chat(options={"num_predict": 3})))


def test_think_defaults_on_where_the_template_can_think(runner):
    template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking %}[thinking on]{% endif %}"
    )
    base = {
        "kind": "chat",
        "messages": USER,
        "template": template,
        "options": {"num_predict": 1, "temperature": 0},
    }
    on = events(runner, base)[-1]["prompt_eval_count"]
    off = events(runner, {**base, "think": False})[-1]["prompt_eval_count"]
    assert on > off


def test_a_thinking_budget_forces_the_end_of_thinking(runner):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}<|im_start|>assistant\n<think>\n"
    base = {
        "kind": "chat",
        "messages": USER,
        "template": template,
        "options": {"num_predict": 24, "temperature": 1.0, "seed": 1},
    }
    free = events(runner, base)
    bound = events(runner, {**base, "think_budget": 4})
    # the random model keeps thinking; with a budget of 4 it is made to stop and answer
    assert not content(free) and content(bound)
    thought = "".join(e.get("thinking", "") for e in bound)
    assert 0 < len(thought) < len("".join(e.get("thinking", "") for e in free))


# -- embeddings ----------------------------------------------------------------------------------


def embed(runner, **body):
    r = runner.post("/embed", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_embeddings_are_mean_pooled_final_hidden_states(runner, tiny_model):
    out = embed(runner, input=["Hello world", "Why is the sky blue?"])
    model = tiny_model[1]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model[0] / "tokenizer.json"))
    for text, vec in zip(["Hello world", "Why is the sky blue?"], out["embeddings"]):
        ids = tok.encode(text).ids
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        want = torch.nn.functional.normalize(hidden.mean(0), dim=0)
        assert torch.allclose(torch.tensor(vec), want, atol=1e-4)
    assert out["prompt_eval_count"] == sum(
        len(tok.encode(t).ids) for t in ["Hello world", "Why is the sky blue?"]
    )


def test_embeddings_batch_equals_singles_and_are_unit_length(runner):
    texts = ["alpha", "beta gamma", "alpha"]
    batch = embed(runner, input=texts)["embeddings"]
    singles = [embed(runner, input=[t])["embeddings"][0] for t in texts]
    assert batch == singles and batch[0] == batch[2] and batch[0] != batch[1]
    for v in batch:
        assert abs(sum(x * x for x in v) - 1.0) < 1e-5
    cut = embed(runner, input=["alpha"], dimensions=8)["embeddings"][0]
    assert len(cut) == 8 and abs(sum(x * x for x in cut) - 1.0) < 1e-5
    raw = embed(runner, input=["alpha"], normalize=False)["embeddings"][0]
    assert abs(sum(x * x for x in raw) - 1.0) > 1e-3


def test_embedding_truncation(runner):
    long = "word " * 2000
    out = embed(runner, input=[long], options={"num_ctx": 64})
    assert out["prompt_eval_count"] == 64
    r = runner.post("/embed", json={"input": [long], "truncate": False})
    assert (
        r.status_code == 400 and r.json()["error"] == "the input length exceeds the context length"
    )
    for bad in (
        {"input": 3},
        {"input": [1, 2]},
        {"input": [""]},
        {"input": ["x"], "dimensions": -1},
    ):
        assert runner.post("/embed", json=bad).status_code == 400


def test_embedding_while_generating_races_nothing(runner):
    idle = embed(runner, input=["steady"])["embeddings"][0]
    body = {
        "kind": "generate",
        "prompt": "go",
        "raw": True,
        "options": {"num_predict": 200, "temperature": 0},
    }
    with cf.ThreadPoolExecutor(3) as ex:
        gens = [ex.submit(events, runner, body) for _ in range(2)]
        time.sleep(0.05)
        during = [embed(runner, input=["steady"])["embeddings"][0] for _ in range(3)]
        outs = [g.result() for g in gens]
    assert all(v == idle for v in during)
    assert all(o[-1]["eval_count"] == 200 for o in outs)
    assert content(outs[0]) == content(outs[1])
