"""Rows of docs/api.md that other tests do not reach: the routes of Ollama's that FreeToken
does not serve, request fields it accepts and ignores, inputs its models cannot read, and a
few chat rules (the Modelfile SYSTEM, the tools capability)."""

from __future__ import annotations

import pytest

from .conftest import SYSTEM

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/api/status"),  # newer Ollama: cloud status
        ("POST", "/api/me"),  # ollama.com account
        ("POST", "/api/signout"),
        ("DELETE", "/api/user/keys/abc"),
        ("POST", "/api/experimental/web_search"),
        ("POST", "/api/experimental/web_fetch"),
        ("GET", "/api/experimental/model-recommendations"),
        ("POST", "/v1/audio/transcriptions"),
    ],
)
def test_routes_not_served_are_404(http, method, path):
    r = http.request(method, path)
    assert (r.status_code, r.text) == (404, "404 page not found")


@pytest.mark.parametrize(
    "path", ["/api/tags", "/api/ps", "/api/loading", "/api/cache", "/v1/models"]
)
def test_get_routes_answer_head(http, path):
    assert http.head(path).status_code == 200


def test_shift_and_debug_render_only_are_accepted_and_ignored(http):
    body = {
        "model": "tiny",
        "prompt": "hi",
        "stream": False,
        "options": {"num_predict": 2},
        "shift": False,
        "_debug_render_only": True,
    }
    r = http.post("/api/generate", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["done"] is True and out["eval_count"] > 0 and "_debug_info" not in out
    r = http.post(
        "/api/chat",
        json={
            "model": "tiny",
            "messages": HI,
            "stream": False,
            "shift": True,
            "options": {"num_predict": 2},
        },
    )
    assert r.status_code == 200 and r.json()["done"] is True


def test_show_verbose_is_accepted_without_tensors(http):
    r = http.post("/api/show", json={"model": "tiny", "verbose": True})
    assert r.status_code == 200
    out = r.json()
    assert "tensors" not in out and out["model_info"]["general.architecture"] == "qwen3moe"


def test_chat_images_are_refused_by_text_models(http):
    r = http.post(
        "/api/chat",
        json={
            "model": "tiny",
            "stream": False,
            "messages": [{"role": "user", "content": "What is this?", "images": ["aGVsbG8="]}],
        },
    )
    assert r.status_code == 400 and "does not support images" in r.json()["error"]


def test_unknown_options_are_ignored(http):
    r = http.post(
        "/api/generate",
        json={
            "model": "tiny",
            "prompt": "hi",
            "stream": False,
            "options": {"num_predict": 1, "mirostat": 2, "no_such_option": "x"},
        },
    )
    assert r.status_code == 200 and r.json()["eval_count"] == 1


def test_adapters_are_refused_on_create(http):
    r = http.post(
        "/api/create",
        json={"model": "x", "from": "tiny", "adapters": {"lora.gguf": "sha256:" + "0" * 64}},
    )
    assert r.status_code == 400 and r.json()["error"] == "adapters are not supported yet"


def _prompt_tokens(http, model, messages):
    r = http.post(
        "/api/chat",
        json={"model": model, "messages": messages, "stream": False, "options": {"num_predict": 1}},
    )
    assert r.status_code == 200, r.text
    # the whole prompt: what was evaluated and what the prefix cache held
    return r.json()["prompt_eval_count"] + r.json()["prompt_cached_count"]


def test_chat_gets_the_modelfile_system_unless_it_sends_its_own(http):
    # "tiny" has SYSTEM "You are terse." (conftest): the same prompt as sending it ourselves
    implicit = _prompt_tokens(http, "tiny", HI)
    assert implicit == _prompt_tokens(http, "tiny", [{"role": "system", "content": SYSTEM}, *HI])
    assert implicit > _prompt_tokens(http, "tiny", [{"role": "system", "content": ""}, *HI])


def test_chat_gets_the_modelfile_messages_first(http):
    history = [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "A test."},
    ]
    r = http.post(
        "/api/create",
        json={"model": "primed", "from": "tiny", "stream": False, "messages": history},
    )
    assert r.status_code == 200, r.text
    system = [{"role": "system", "content": SYSTEM}]
    assert _prompt_tokens(http, "primed", HI) == _prompt_tokens(
        http, "tiny", [*system, *history, *HI]
    )
    assert http.request("DELETE", "/api/delete", json={"model": "primed"}).status_code == 200


def test_tools_need_a_template_that_reads_them(http):
    r = http.post(
        "/api/create",
        json={"model": "no-tools", "from": "tiny", "stream": False, "template": "{{ .Prompt }}"},
    )
    assert r.status_code == 200, r.text
    assert http.post("/api/show", json={"model": "no-tools"}).json()["capabilities"] == [
        "completion"
    ]
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    r = http.post("/api/chat", json={"model": "no-tools", "messages": HI, "tools": [tool]})
    assert r.status_code == 400
    assert r.json() == {
        "error": "registry.ollama.ai/library/no-tools:latest does not support tools"
    }
    assert http.request("DELETE", "/api/delete", json={"model": "no-tools"}).status_code == 200
