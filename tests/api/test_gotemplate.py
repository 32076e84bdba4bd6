"""A model whose Modelfile TEMPLATE is an Ollama Go template, served for real: the prompt
the runner tokenizes is exactly the one the template gives, read back from the token ids
/api/generate returns as `context`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from freetoken.store import CreateSpec, Store
from freetoken.tools import synth
from tests.fixtures import SYNTH_TINY
from tests.server.harness import LiveServer, make_config

CHATML = """\
{{- if or .System .Tools }}<|im_start|>system
{{ .System }}
{{- if .Tools }}
Tools: {{ json .Tools }}
{{- end }}<|im_end|>
{{ end }}
{{- range .Messages }}
{{- if ne .Role "system" }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}
{{- end }}<|im_start|>assistant
"""
LEGACY = (
    "{{ if .System }}SYSTEM: {{ .System }}\n{{ end }}USER: {{ .Prompt }}\n"
    "ASSISTANT: {{ .Response }}<|im_end|>\n"
)
FIM = "<|im_start|>{{ .Prompt }}<|endoftext|>{{ .Suffix }}<|im_end|>"
TOOL = {
    "type": "function",
    "function": {
        "name": "now",
        "description": "The time",
        "parameters": {"type": "object", "properties": {}},
    },
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Tokenizer]]:
    root = tmp_path_factory.mktemp("go-template")
    model_dir = synth.write_qwen3_moe(root / "src", **SYNTH_TINY)
    store = Store(root / "models")
    for name, template, system in (("go-chatml", CHATML, "You are terse."), ("go-fim", FIM, None)):
        spec = CreateSpec(name=name, from_=str(model_dir), template=template, system=system)
        for _ in store.plan_create(spec).run():
            pass
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    with (
        LiveServer(make_config(root / "models")) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as http,
    ):
        yield http, tok


def _prompt_of(served: tuple[httpx.Client, Tokenizer], **body: Any) -> str:
    http, tok = served
    r = http.post(
        "/api/generate", json={"raw": False, "stream": False, "options": {"num_predict": 1}, **body}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    n = out["prompt_eval_count"] + out["prompt_cached_count"]  # evaluated and reused
    assert len(out["context"]) == n + out["eval_count"]
    return tok.decode(out["context"][:n], skip_special_tokens=False)


def test_generate_renders_the_modelfile_template(served):
    assert _prompt_of(served, model="go-chatml", prompt="Why is the sky blue?") == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generate_request_system_replaces_the_modelfile_one(served):
    assert _prompt_of(served, model="go-chatml", prompt="Hi", system="Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_generate_with_a_legacy_request_template_is_cut_after_response(served):
    assert (
        _prompt_of(served, model="go-chatml", prompt="Hi", template=LEGACY)
        == "SYSTEM: You are terse.\nUSER: Hi\nASSISTANT: "
    )


def test_generate_with_a_suffix_fills_in_the_middle(served):
    assert (
        _prompt_of(served, model="go-fim", prompt="def add(", suffix="return x")
        == "<|im_start|>def add(<|endoftext|>return x<|im_end|>"
    )


def test_capabilities_come_from_what_the_go_template_reads(served):
    http, _ = served
    caps = {
        m: http.post("/api/show", json={"model": m}).json()["capabilities"]
        for m in ("go-chatml", "go-fim")
    }
    assert caps == {"go-chatml": ["completion", "tools"], "go-fim": ["completion", "insert"]}
    r = http.post("/api/generate", json={"model": "go-chatml", "prompt": "x", "suffix": "y"})
    assert r.status_code == 400 and "does not support insert" in r.json()["error"]


def test_chat_with_tools_renders_them_into_the_prompt(served):
    http, tok = served
    r = http.post(
        "/api/chat",
        json={
            "model": "go-chatml",
            "stream": False,
            "tools": [TOOL],
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 1},
        },
    )
    assert r.status_code == 200, r.text
    expected = (
        "<|im_start|>system\nYou are terse.\nTools: "
        '[{"type":"function","function":{"name":"now","description":"The time",'
        '"parameters":{"type":"object","properties":{}}}}]<|im_end|>\n'
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    prompt = r.json()["prompt_eval_count"] + r.json()["prompt_cached_count"]
    assert prompt == len(tok.encode(expected, add_special_tokens=False).ids)
