"""Through the HTTP API, the served model continues text exactly as transformers does."""

from __future__ import annotations

import httpx
import pytest

from freetoken.store import CreateSpec, Store
from tests import fixtures
from tests.fixtures_gguf import write_gguf
from tests.server.harness import LiveServer, make_config

PROMPT = "The quick brown fox jumps over the lazy dog. def parse(text):"


@pytest.fixture(scope="module")
def ref_server(tiny_model, tmp_path_factory):
    path, hf = tiny_model
    root = tmp_path_factory.mktemp("ref-models")
    gguf = write_gguf(hf, path, tmp_path_factory.mktemp("gguf") / "ref.gguf", "F32")
    for name, src in (("ref", path), ("ref-gguf", gguf)):
        for _ in Store(root).plan_create(CreateSpec(name=name, from_=str(src))).run():
            pass
    with LiveServer(make_config(root)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        yield http, hf, path


def _hf_continuation(hf, path, n):
    from freetoken.runtime.tokenizer import Tokenizer
    from tests.runtime.engine_util import files_of

    tok = Tokenizer(files_of(path))
    ids = tok.encode(PROMPT)
    out = fixtures.hf_greedy(hf, ids, n)
    stops = [i for i, t in enumerate(out) if t in tok.eos_ids]
    out = out[: stops[0]] if stops else out
    return ids, out, tok.decode(out)


@pytest.mark.parametrize("model", ["ref", "ref-gguf"])
def test_raw_greedy_generation_matches_transformers(ref_server, model):
    """Both the Hugging Face directory and the F32 GGUF made from it were converted to FTW."""
    http, hf, path = ref_server
    _, _, text = _hf_continuation(hf, path, 32)
    r = http.post(
        "/api/generate",
        json={
            "model": model,
            "prompt": PROMPT,
            "raw": True,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 32},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["response"] == text


def test_streamed_greedy_tokens_match_transformers_token_for_token(ref_server):
    http, hf, path = ref_server
    prompt_ids, out_ids, text = _hf_continuation(hf, path, 32)
    # a non-raw request returns `context`: the token ids of prompt and answer
    r = http.post(
        "/api/generate",
        json={
            "model": "ref",
            "prompt": PROMPT,
            "template": "{{ messages[0].content }}",
            "stream": False,
            "options": {"temperature": 0, "num_predict": 32},
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["context"] == prompt_ids + out_ids
    assert body["eval_count"] == len(out_ids)


def test_prompt_longer_than_num_ctx(ref_server):
    http, _, _ = ref_server
    long = "word " * 600
    r = http.post(
        "/api/generate",
        json={
            "model": "ref",
            "prompt": long,
            "raw": True,
            "stream": False,
            "options": {"num_ctx": 128, "num_predict": 4},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] < 128
    r = http.post(
        "/api/generate",
        json={
            "model": "ref",
            "prompt": long,
            "raw": True,
            "stream": False,
            "truncate": False,
            "options": {"num_ctx": 128, "num_predict": 4},
        },
    )
    assert r.status_code == 400
    assert "exceeds the context length" in r.json()["error"]
    r = http.post(
        "/api/chat",
        json={
            "model": "ref",
            "stream": False,
            "truncate": False,
            "messages": [{"role": "user", "content": long}],
            "options": {"num_ctx": 128},
        },
    )
    assert r.status_code == 400
