"""Embeddings through the real server: /api/embed, /api/embeddings and /v1/embeddings."""

from __future__ import annotations

import base64
import math
import struct

import ollama
import pytest

from tests.server.harness import TINY

HIDDEN = TINY["hidden_size"]


def norm(v) -> float:
    return math.sqrt(sum(x * x for x in v))


def test_embed_shapes_and_normalisation(client):
    r = client.embed("tiny", input=["Why is the sky blue?", "Hello"])
    assert r.model == "tiny" and len(r.embeddings) == 2
    assert all(len(v) == HIDDEN and abs(norm(v) - 1) < 1e-5 for v in r.embeddings)
    assert r.prompt_eval_count > 2 and r.total_duration >= r.load_duration >= 0
    one = client.embed("tiny", input="Hello")
    assert len(one.embeddings) == 1


def test_equal_inputs_equal_vectors_and_batch_equals_singles(client):
    texts = ["alpha beta", "gamma", "alpha beta"]
    batch = client.embed("tiny", input=texts).embeddings
    singles = [client.embed("tiny", input=t).embeddings[0] for t in texts]
    assert batch == singles
    assert batch[0] == batch[2] and batch[0] != batch[1]


def test_dimensions_and_truncate(client):
    cut = client.embed("tiny", input="Hello", dimensions=8).embeddings[0]
    assert len(cut) == 8 and abs(norm(cut) - 1) < 1e-5
    long = "word " * 5000
    r = client.embed("tiny", input=long, options={"num_ctx": 128})
    assert r.prompt_eval_count == 128
    with pytest.raises(ollama.ResponseError) as e:
        client.embed("tiny", input=long, truncate=False, options={"num_ctx": 128})
    assert e.value.status_code == 400 and "exceeds the context length" in e.value.error


def test_empty_input_only_loads_the_model(http):
    r = http.post("/api/embed", json={"model": "tiny", "input": []})
    assert r.status_code == 200 and r.json()["embeddings"] == []


@pytest.mark.parametrize(
    "body", [{"input": 3}, {"input": [1, 2]}, {"input": {"a": 1}}, {"input": ["ok", None]}]
)
def test_invalid_input_type(http, body):
    r = http.post("/api/embed", json={"model": "tiny", **body})
    assert r.status_code == 400 and r.json()["error"] == "invalid input type"


def test_unknown_model_is_404(http):
    r = http.post("/api/embed", json={"model": "nope", "input": "x"})
    assert r.status_code == 404


def test_legacy_embeddings(client):
    r = client.embeddings("tiny", prompt="Hello")
    assert len(r.embedding) == HIDDEN
    unit = client.embed("tiny", input="Hello").embeddings[0]
    scale = norm(r.embedding)
    # the older endpoint gives the raw mean; the direction is the same
    assert all(abs(a / scale - b) < 1e-5 for a, b in zip(r.embedding, unit))
    assert client.embeddings("tiny", prompt="").embedding == []


def test_v1_embeddings_float_and_base64(http):
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": ["Hello", "World"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == HIDDEN for d in body["data"])
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    r = http.post(
        "/v1/embeddings",
        json={"model": "tiny", "input": "Hello", "encoding_format": "base64", "dimensions": 4},
    )
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    vec = struct.unpack("<4f", raw)
    assert abs(norm(vec) - 1) < 1e-5
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": "x", "encoding_format": "hex"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": [[1, 2, 3]]})
    assert r.status_code == 400
