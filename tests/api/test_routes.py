"""Routing, parsing and error answers: none of these needs a model to run."""

import hashlib

import pytest

from freetoken import OLLAMA_VERSION


def test_root_says_ollama_is_running(http):
    r = http.get("/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    assert r.headers["content-type"].startswith("text/plain")
    assert http.head("/").status_code == 200


def test_version(http):
    assert http.get("/api/version").json() == {"version": OLLAMA_VERSION}
    assert http.head("/api/version").status_code == 200


def test_unknown_route_and_wrong_method(http):
    r = http.get("/v1")
    assert (r.status_code, r.text) == (404, "404 page not found")
    assert http.get("/api/generate").status_code == 405
    assert http.post("/api/tags").status_code == 405
    assert http.head("/api/tags").status_code == 200


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{bad", "invalid character 'b' looking for beginning of object key string"),
        (b'{"model": "tiny"} x', "invalid character 'x' after top-level value"),
        (b'{"model": ', "unexpected EOF"),
        (b"", "missing request body"),
        (b"[1, 2]", "cannot unmarshal array into a request object"),
        (b"{}", "model is required"),
        (b'{"model": 7}', 'invalid value for "model": cannot unmarshal number into string'),
    ],
)
@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/api/show"])
def test_malformed_requests_are_400(http, path, body, message):
    r = http.post(path, content=body)
    assert r.status_code == 400 and r.json() == {"error": message}


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("POST", "/api/generate", {"model": "nope", "prompt": "hi"}),
        ("POST", "/api/chat", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/api/show", {"model": "nope"}),
        ("POST", "/api/show", {"name": "nope"}),
        ("DELETE", "/api/delete", {"model": "nope"}),
        ("POST", "/api/generate", {"model": "not a valid name!"}),
    ],
)
def test_unknown_model_is_404(http, method, path, body):
    r = http.request(method, path, json=body)
    name = body.get("model") or body.get("name")
    assert r.status_code == 404 and r.json() == {"error": f"model '{name}' not found"}


@pytest.mark.parametrize(
    "body, message",
    [
        ({"options": {"temperature": "hot"}}, 'option "temperature" must be of type number'),
        ({"options": {"num_predict": 1.5}}, 'option "num_predict" must be of type integer'),
        ({"options": {"stop": [1]}}, 'option "stop" must be of type array of strings'),
        ({"options": "fast"}, "options must be an object"),
        ({"raw": True, "system": "s"}, "raw mode does not support template, system, or context"),
        (
            {"raw": True, "context": [1, 2]},
            "raw mode does not support template, system, or context",
        ),
        ({"keep_alive": "forever"}, 'time: invalid duration "forever"'),
        ({"think": "hard"}, 'invalid think value "hard"'),
        ({"think": True}, '"tiny" does not support thinking'),
        ({"format": "xml"}, 'invalid format: expected "json" or a JSON schema'),
        ({"stream": "yes"}, 'invalid value for "stream"'),
    ],
)
def test_bad_generate_fields_are_400(http, body, message):
    r = http.post("/api/generate", json={"model": "tiny", "prompt": "hi", **body})
    assert r.status_code == 400 and r.json()["error"].startswith(message)


def test_bad_chat_messages_are_400(http):
    r = http.post(
        "/api/chat", json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}
    )
    assert r.status_code == 400 and "role" in r.json()["error"]
    r = http.post("/api/chat", json={"model": "tiny", "messages": "hi"})
    assert r.status_code == 400


def test_blob_upload_and_check(http):
    data = b"some bytes"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = http.head(f"/api/blobs/{digest}")
    assert r.status_code == 404
    r = http.post(f"/api/blobs/{digest}", content=data)
    assert r.status_code == 201
    assert http.post(f"/api/blobs/{digest}", content=data).status_code == 200
    assert http.head(f"/api/blobs/{digest}").status_code == 200
    assert http.head(f"/api/blobs/{digest.replace(':', '-')}").status_code == 200


def test_blob_errors(http):
    wrong = "sha256:" + "0" * 64
    r = http.post(f"/api/blobs/{wrong}", content=b"abc")
    got = "sha256:" + hashlib.sha256(b"abc").hexdigest()
    assert r.status_code == 400
    assert r.json() == {"error": f'digest mismatch, expected "{wrong}", got "{got}"'}
    assert http.head(f"/api/blobs/{wrong}").status_code == 404
    assert http.post(f"/api/blobs/{wrong}", content=b"x").status_code == 400
    assert http.head("/api/blobs/sha256:xyz").status_code == 400
    assert http.post("/api/blobs/md5:abc", content=b"x").status_code == 400


def test_copy_errors(http):
    r = http.post("/api/copy", json={"source": "nope", "destination": "x"})
    assert r.status_code == 404 and r.json() == {"error": 'model "nope" not found'}
    r = http.post("/api/copy", json={"source": "tiny", "destination": "bad name!"})
    assert r.status_code == 400 and r.json() == {"error": 'destination "bad name!" is invalid'}
    assert http.post("/api/copy", json={"source": "tiny"}).status_code == 400


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"model": "x"}, 400, "neither 'from' or 'files' was specified"),
        ({"model": "x", "from": "nope"}, 404, "model 'nope' not found"),
        ({"model": "bad name!", "from": "tiny"}, 400, "invalid model name"),
        ({"from": "tiny"}, 400, "model is required"),
        (
            {"model": "x", "from": "tiny", "quantize": "q3_K_S"},
            400,
            "unsupported quantization type 'q3_K_S' (supported: q4_K_M, q8_0)",
        ),
    ],
)
def test_create_errors(http, body, status, message):
    r = http.post("/api/create", json=body)
    assert r.status_code == status and r.json()["error"].startswith(message)
