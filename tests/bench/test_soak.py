"""The soak harness's own judgement: what counts as a finished stream, a wrong answer, a
broken store. (Its runs are by hand: docs/benchmarks.md records them.)"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from freetoken.bench import fuzz, soak_fuzz, soak_load
from freetoken.bench.soak_faults import Throttle, check_store
from freetoken.store import Store
from freetoken.store import manifest as mf


@pytest.mark.parametrize(
    "api, line, end",
    [
        ("/api/chat", '{"message": {"content": "x"}, "done": false}', None),
        ("/api/chat", '{"done": true, "eval_count": 5}', "ok"),
        ("/api/generate", '{"error": "boom"}', "error event"),
        ("/v1/chat/completions", 'data: {"choices": []}', None),
        ("/v1/chat/completions", "data: [DONE]", "ok"),
        ("/v1/messages", "event: message_stop", "ok"),
        ("/v1/messages", "event: error", "error event"),
    ],
)
def test_stream_ends_are_read_per_api(api, line, end):
    assert soak_load._event(api, line)[0] == end


def test_tokens_are_counted_from_usage():
    assert soak_load._event("/v1/chat/completions", 'data: {"usage": {"completion_tokens": 7}}')
    assert soak_load._event("/api/chat", '{"done": true, "eval_count": 5}') == ("ok", 5)


_OPENAI = {"message": "m", "param": None, "code": None}


@pytest.mark.parametrize(
    "api, status, body, wrong",
    [
        ("ollama", 400, {"error": "bad"}, None),
        ("ollama", 400, {"error": "bad", "extra": 1}, "shape"),
        ("openai", 400, {"error": {**_OPENAI, "type": "invalid_request_error"}}, None),
        ("openai", 400, {"error": {**_OPENAI, "type": "api_error"}}, "shape"),
        ("openai", 400, {"error": {"message": "m", "type": "invalid_request_error"}}, "shape"),
        (
            "anthropic",
            400,
            {"type": "error", "error": {"type": "api_error", "message": "m"}},
            "shape",
        ),
        (
            "anthropic",
            404,
            {"type": "error", "error": {"type": "not_found_error", "message": "m"}},
            None,
        ),
        ("ollama", 500, {"error": "x"}, "5xx"),
    ],
)
def test_verdicts(api, status, body, wrong):
    case = fuzz.Case("POST", "/x", b"{}", api, "t")
    assert fuzz.verdict(case, status, "application/json", json.dumps(body).encode()) == wrong
    if status < 500:
        assert fuzz.verdict(case, status, "text/plain", b"Internal Server Error") == "shape"


def test_encode_writes_raw_tokens():
    body = {"a": fuzz.Raw("NaN"), "b": [fuzz.Raw('"\\ud800"')], "c": "NaN"}
    assert fuzz.encode(body) == b'{"a": NaN, "b": ["\\ud800"], "c": "NaN"}'


def test_check_store_finds_half_models(tmp_path):
    store = Store(tmp_path)
    config = store.blobs.put_bytes(b"{}")
    whole = mf.Manifest(mf.Layer(mf.CONFIG, config, 2))
    store.write_manifest(store_name("whole"), whole)
    half = mf.Manifest(mf.Layer(mf.CONFIG, "sha256:" + "1" * 64, 5))
    mf.write(store.manifests / store_name("half").manifest_path, half)
    assert check_store(tmp_path) == {
        "listed": ["whole:latest"],
        "broken listed": [],
        "half on disk": 1,
    }


def store_name(name: str):
    from freetoken.store import Name

    return Name.parse(name)


def test_throttle_passes_and_counts_what_the_upstream_sends():
    with socket.socket() as upstream:
        upstream.bind(("127.0.0.1", 0))
        upstream.listen()

        def serve():
            conn, _ = upstream.accept()
            conn.recv(10)
            conn.sendall(b"x" * 50_000)
            conn.close()

        threading.Thread(target=serve, daemon=True).start()
        throttle = Throttle(upstream.getsockname()[1], rate=10 << 20)
        with socket.create_connection(("127.0.0.1", throttle.port)) as c:
            c.sendall(b"hello")
            got = b""
            while chunk := c.recv(65536):
                got += chunk
    assert got == b"x" * 50_000 and throttle.sent == 50_000


def test_a_fuzz_case_still_answering_at_its_deadline_is_cut_not_failed():
    # num_predict -1 runs to the context's end: the fuzz hangs up rather than wait minutes
    def endless(request):
        return httpx.Response(200, content=iter([b'{"done": false}\n'] * 1000))

    case = fuzz.Case("POST", "/api/chat", b"{}", "ollama", "t")
    with httpx.Client(transport=httpx.MockTransport(endless), base_url="http://x") as client:
        assert soak_fuzz._send(client, case, 0.0) == ("cut", 200, "still answering")
        assert soak_fuzz._send(client, case, 60.0)[:2] == (None, 200)
