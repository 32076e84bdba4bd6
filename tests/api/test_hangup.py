"""A request waiting for its model (to load, or for its turn) ends when its client hangs up:
nobody is left to load it for. Requests that generate have been ended so for long (their
answer streams inside the response); the ones that only load, embed or count tokens wait
inside their response too now."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

WAITS = [
    ("/api/generate", {"model": "tiny", "prompt": ""}),
    ("/api/chat", {"model": "tiny", "messages": []}),
    ("/api/embed", {"model": "tiny", "input": "hello"}),
    ("/api/embeddings", {"model": "tiny", "prompt": "hello"}),
    ("/v1/embeddings", {"model": "tiny", "input": "hello"}),
    (
        "/v1/messages/count_tokens",
        {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]},
    ),
]


@pytest.mark.parametrize("route, body", WAITS, ids=[r for r, _ in WAITS])
def test_a_wait_for_the_model_ends_when_its_client_hangs_up(server, monkeypatch, route, body):
    entered, cancelled = threading.Event(), threading.Event()

    async def waits_forever(view, spec, keep_alive):
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(server.services.residency, "acquire", waits_forever)
    with httpx.Client(base_url=server.url) as http, pytest.raises(httpx.ReadTimeout):
        http.post(route, json=body, timeout=1.0)
    assert entered.is_set()
    assert cancelled.wait(5), "the server went on waiting for a client that had left"


def test_a_load_still_answers_in_ollamas_shape(http):
    for route, body in WAITS[:2]:
        r = http.post(route, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert list(out)[:2] == ["model", "created_at"]
        assert out["done"] is True and out["done_reason"] == "load"
    r = http.post("/api/generate", json={"model": "nope", "prompt": ""})
    assert r.status_code == 404 and set(r.json()) == {"error"}
