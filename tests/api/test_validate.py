"""The request validator: strict JSON, integer ranges, tools, and each refusal in the shape of
the API it was sent to (issue 22's fuzz found each of these as a 5xx or a wrong 200)."""

from __future__ import annotations

import json

import pytest

from freetoken.api.errors import APIError
from freetoken.api.validate import MAX_DEPTH, check_tools, parse_json

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "raw, message",
    [
        (b'{"a": NaN}', "invalid character 'N' looking for beginning of value"),
        (b'{"a": Infinity}', "invalid character 'I' looking for beginning of value"),
        (b'{"a": -Infinity}', "invalid character 'I' in numeric literal"),
        (b'{"a": 1e400}', "json: cannot unmarshal number 1e400 into Go value of type float64"),
        (b'{"a": -1e400}', "json: cannot unmarshal number -1e400"),
        (b'{"a": ' + b"9" * 5000 + b"}", "json: cannot unmarshal number 9999"),
        (b'\xef\xbb\xbf{"model": "x"}', "invalid character 'ï' looking for beginning of value"),
        (b'{"a": "\xff"}', "invalid request body: not UTF-8"),
        (b'{"a": "\\ud800"}', "invalid request body: a string holds a lone UTF-16 surrogate"),
        (b'{"\\udfff": 1}', "invalid request body: a string holds a lone UTF-16 surrogate"),
        (b'{"a": "x\x01"}', "invalid character '\\x01' in string literal"),
        (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid request body: nested"),
        (b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", "invalid request body: nested"),
        (b"[]", "cannot unmarshal array into a request object"),
    ],
)
def test_what_go_refuses_is_a_400(raw, message):
    with pytest.raises(APIError) as e:
        parse_json(raw)
    assert e.value.status == 400 and e.value.message.startswith(message)


def test_what_go_accepts_parses():
    body = parse_json(b'{"a": "\\ud83d\\ude00", "b": 1.5e300, "c": -9223372036854775808}')
    assert body == {"a": "\U0001f600", "b": 1.5e300, "c": -(2**63)}
    deep = b'{"a": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert isinstance(parse_json(deep)["a"], list)
    assert parse_json(b'{"n": 123456789012345678901234}')["n"] == 1.2345678901234568e23


@pytest.mark.parametrize(
    "tools, message",
    [
        ([1, 2], 'invalid value for "tools[0]": cannot unmarshal number into object'),
        ([{"function": "f"}], 'invalid value for "tools[0].function": cannot unmarshal string'),
        ([{"function": {}}], 'invalid value for "tools[0].function.name": expected a string'),
        ([{"function": {"name": 3}}], '"tools[0].function.name": expected a string, got number'),
        ([{"type": "web", "function": {"name": "f"}}], 'invalid value for "tools[0].type"'),
        ([{"function": {"name": "f", "parameters": []}}], '"tools[0].function.parameters"'),
    ],
)
def test_garbage_tools_are_refused(tools, message):
    with pytest.raises(APIError) as e:
        check_tools(tools)
    assert e.value.status == 400 and message in e.value.message


# -- through the server: each API's own error shape ---------------------------------------


def _anthropic_400(r):
    body = r.json()
    return (
        r.status_code == 400
        and body["type"] == "error"
        and (body["error"]["type"] == "invalid_request_error")
    )


def _openai_400(r):
    body = r.json()
    return r.status_code == 400 and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path, ok",
    [
        ("/api/chat", lambda r: r.status_code == 400 and set(r.json()) == {"error"}),
        ("/api/delete", lambda r: r.status_code == 400 and set(r.json()) == {"error"}),
        ("/v1/chat/completions", _openai_400),
        ("/v1/embeddings", _openai_400),
        ("/v1/messages", _anthropic_400),
    ],
)
@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "tiny", "x": NaN}',
        b'{"model": "tiny\\udc00"}',
        b'\xef\xbb\xbf{"model": "tiny"}',
        b'{"model": ' + b"[" * 50_000,
        b'{"model": "tiny", "seed": 1e999}',
    ],
)
def test_bad_json_is_a_400_in_the_apis_own_shape(http, path, ok, raw):
    method = "DELETE" if path == "/api/delete" else "POST"
    r = http.request(method, path, content=raw)
    assert ok(r), r.text
    # the connection survives the refusal (a keep-alive client goes on)
    assert http.get("/api/version").status_code == 200


def test_a_bom_body_deletes_nothing(http, server):
    r = http.request("DELETE", "/api/delete", content=b'\xef\xbb\xbf{"model": "capped"}')
    assert r.status_code == 400
    assert "capped:latest" in {m["name"] for m in http.get("/api/tags").json()["models"]}


@pytest.mark.parametrize(
    "body, message",
    [
        ({"options": {"seed": 2**64}}, 'option "seed" is out of range for a 64-bit integer'),
        ({"options": {"num_ctx": 1}}, 'option "num_ctx" must be greater than 1'),
        ({"options": {"num_ctx": -5}}, 'option "num_ctx" must be greater than 1'),
        ({"options": {"temperature": 1e39}}, 'option "temperature" must be a finite number'),
        ({"options": {"repeat_penalty": 0}}, 'option "repeat_penalty" must be greater than 0'),
        ({"options": {"repeat_penalty": -1.5}}, 'option "repeat_penalty" must be greater than'),
        ({"options": {"moe_policy": "fastest"}}, 'option "moe_policy" must be one of adaptive'),
        ({"options": {"vram_budget": "lots"}}, 'option "vram_budget" must be a size'),
        ({"keep_alive": "NaN"}, 'time: invalid duration "NaN"'),
        ({"keep_alive": "1e400"}, 'time: invalid duration "1e400"'),
        ({"top_logprobs": 2**70}, 'invalid value for "top_logprobs": number 1.18059e+21 is not'),
        ({"tools": [1, 2]}, 'invalid value for "tools[0]"'),
        ({"tools": [{"type": "function", "function": "f"}]}, 'invalid value for "tools[0].fun'),
    ],
)
def test_bad_values_are_400_before_any_runner_starts(http, server, body, message):
    r = http.post("/api/chat", json={**CHAT, **body})
    assert r.status_code == 400 and r.json()["error"].startswith(message), r.text
    assert server.services.residency.runners() == {}


@pytest.mark.parametrize("context", [[-1], [2**40], ["a"], [True]])
def test_negative_or_absurd_context_ids_are_400(http, context):
    r = http.post("/api/generate", json={"model": "tiny", "prompt": "hi", "context": context})
    assert r.status_code == 400 and "context" in r.json()["error"]


def test_huge_keep_alive_is_forever_and_ps_stays_readable(http):
    r = http.post("/api/generate", json={"model": "tiny", "keep_alive": 1e300})
    assert r.status_code == 200 and r.json()["done_reason"] == "load"
    ps = http.get("/api/ps")
    assert ps.status_code == 200 and ps.json()["models"][0]["expires_at"] > "2200"
    http.post("/api/generate", json={"model": "tiny", "keep_alive": 0})


def test_create_refuses_parameters_that_would_break_every_chat(http):
    for params in ({"temperature": "nan"}, {"num_ctx": "inf"}, {"num_ctx": 1}):
        r = http.post("/api/create", json={"model": "broken", "from": "tiny", "parameters": params})
        assert r.status_code == 400, (params, r.text)
    r = http.post(
        "/api/create",
        json={"model": "broken", "modelfile": "FROM tiny\nPARAMETER temperature nan"},
    )
    assert r.status_code == 400 and "finite" in r.json()["error"]
    bad = {"model": "broken", "from": "tiny", "license": ["ok", 3]}
    assert http.post("/api/create", json=bad).status_code == 400
    names = {m["name"] for m in http.get("/api/tags").json()["models"]}
    assert "broken:latest" not in names


def test_v1_refusals(v1_http):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    for extra in (
        {"max_tokens": -1},
        {"max_completion_tokens": -5},
        {"tools": [1, 2]},
        {"tool_choice": "sometimes", "tools": []},
        {"tool_choice": {"type": "function"}},
        {"seed": 2**64},
        {"temperature": 1e39},
    ):
        r = v1_http.post("/v1/chat/completions", json={**chat, **extra})
        assert _openai_400(r), (extra, r.text)
    r = v1_http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -2})
    assert _openai_400(r)


def test_anthropic_refusals(v1_http):
    msg = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    for extra in (
        {"max_tokens": -1},
        {"max_tokens": 0},
        {"tool_choice": {"type": "sometimes"}},
        {"tool_choice": {"type": "tool"}},
        {"tools": [{"name": 3, "input_schema": {}}]},
    ):
        r = v1_http.post("/v1/messages", json={**msg, **extra})
        assert _anthropic_400(r), (extra, r.text)


def test_error_messages_echoing_odd_text_still_render(http):
    # a model name with characters JSON must escape comes back intact in the error
    name = 'nope"\\\u2028'
    r = http.post("/api/show", content=json.dumps({"model": name}).encode())
    assert r.status_code == 404 and name in r.json()["error"]


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "object", "properties": [1]},
        {"$ref": "#/nope"},
        {"$ref": "https://example.com/schema"},
        {"type": "object", "properties": {"a": {}}, "required": ["b"]},
        {"items": 3, "type": "array"},
    ],
)
def test_unusable_format_schemas_are_400_before_any_runner(http, v1_http, server, fmt):
    r = http.post("/api/chat", json={**CHAT, "format": fmt})
    # in the runner's words (tests/api/test_client.py): a refusal reads the same wherever
    assert r.status_code == 400 and r.json()["error"].startswith("format: "), r.text
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": fmt}}
    r = v1_http.post("/v1/chat/completions", json={**CHAT, "response_format": rf})
    assert _openai_400(r) and "format: " in r.json()["error"]["message"]
    assert server.services.residency.runners() == {}
