"""Through the HTTP API, a Q4_K_M GGUF (its experts kept packed) continues text exactly as
transformers does with the weights the file decodes to, and /api/show names its
quantization as the file does."""

from __future__ import annotations

import httpx
import pytest

from freetoken.store import CreateSpec, Store
from tests import fixtures
from tests.fixtures_gguf import dequantized_model, write_gguf
from tests.server.harness import LiveServer, make_config

PROMPT = "The quick brown fox jumps over the lazy dog. def parse(text):"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf = fixtures.hf_qwen3_moe(
        path, seed=9, hidden_size=256, intermediate_size=256, moe_intermediate_size=256
    )
    out = tmp_path_factory.mktemp("gguf") / "q.gguf"
    gguf = write_gguf(hf, path, out, "Q4_K_M", file_type=15)  # llama.cpp's MOSTLY_Q4_K_M
    root = tmp_path_factory.mktemp("models")
    for _ in Store(root).plan_create(CreateSpec(name="q", from_=str(gguf))).run():
        pass
    # the runner (a child process, with this environment) computes in fp32, asked for: the
    # reference computes the decoded weights in fp32; and with a cache of 12 slots of 16
    mp = pytest.MonkeyPatch()
    mp.setenv("FREETOKEN_DTYPE", "float32")
    mp.setenv("FREETOKEN_EXPERT_SLOTS", "12")
    with LiveServer(make_config(root)) as srv, httpx.Client(base_url=srv.url, timeout=120) as http:
        yield http, dequantized_model(hf, gguf, "qwen3moe"), path
    mp.undo()


def test_greedy_continuation_is_transformers_on_the_decoded_weights(served):
    from freetoken.runtime.tokenizer import Tokenizer
    from tests.runtime.engine_util import files_of

    http, ref, path = served
    tok = Tokenizer(files_of(path))
    ids = tok.encode(PROMPT)
    want = fixtures.hf_greedy(ref, ids, 16)
    r = http.post(
        "/api/generate",
        json={
            "model": "q",
            "prompt": PROMPT,
            "template": "{{ messages[0].content }}",
            "stream": False,
            "options": {"temperature": 0, "num_predict": 16},
        },
    )
    assert r.status_code == 200, r.text
    stops = [i for i, t in enumerate(want) if t in tok.eos_ids]
    want = want[: stops[0]] if stops else want
    assert r.json()["context"] == ids + want


def test_show_reports_the_files_quantization(served):
    http, _, _ = served
    r = http.post("/api/show", json={"model": "q"})
    assert r.status_code == 200, r.text
    assert r.json()["details"]["quantization_level"] == "Q4_K_M"
