"""The OpenAI-compatible routes' failures, as the real `openai` SDK and plain HTTP see them:
errors in OpenAI's shape with the status they began with, bad messages and fields refused
before a runner is asked, and a client or runner that goes away mid-answer.
"""

import os
import signal
import time

import httpx
import openai
import pytest

HI = [{"role": "user", "content": "Why is the sky blue?"}]


def test_runner_death_mid_stream_is_an_error_event(oai, v1_server):
    stream = oai.chat.completions.create(
        model="endless", messages=HI, max_tokens=100000, stream=True
    )
    next(iter(stream))
    os.kill(v1_server.runner_pid("endless:latest"), signal.SIGKILL)
    with pytest.raises(openai.APIError, match="model runner has unexpectedly stopped"):
        for _ in stream:
            pass


# -- errors -----------------------------------------------------------------------------


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


@pytest.mark.parametrize(
    "body, status, error",
    [
        (
            {"model": "nope", "messages": HI},
            404,
            _error("model 'nope' not found", "not_found_error"),
        ),
        (
            {"model": "tiny", "messages": []},
            400,
            _error("[] is too short - 'messages'", "invalid_request_error"),
        ),
        ({"model": "tiny"}, 400, _error("[] is too short - 'messages'", "invalid_request_error")),
        ({"messages": HI}, 400, _error("model is required", "invalid_request_error")),
    ],
)
def test_error_shapes(v1_http, body, status, error):
    r = v1_http.post("/v1/chat/completions", json=body)
    assert (r.status_code, r.json()) == (status, error)


@pytest.mark.parametrize(
    "message, error",
    [
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                ],
            },
            "invalid tool call arguments",
        ),
        (
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
                ],
            },
            "does not support image_url input",
        ),
        ({"role": "wizard", "content": "x"}, "invalid message role"),
    ],
)
def test_bad_messages_are_400(oai, message, error):
    with pytest.raises(openai.BadRequestError, match=error):
        oai.chat.completions.create(model="tiny", messages=[message, *HI])


def test_bad_fields_are_400(oai):
    with pytest.raises(openai.BadRequestError, match="invalid reasoning effort"):
        oai.chat.completions.create(model="tiny", messages=HI, reasoning_effort="extreme")
    with pytest.raises(openai.BadRequestError, match="does not support thinking"):
        oai.chat.completions.create(model="tiny", messages=HI, reasoning_effort="high")
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model="tiny", messages=HI, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model="tiny", messages=HI, extra_body={"temperature": "hot"})


def test_malformed_json_is_an_openai_400(v1_http):
    r = v1_http.post("/v1/chat/completions", content=b"{bad")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_generation_in_the_runner(v1_server, stream):
    body = {"model": "endless", "messages": HI, "max_tokens": 100000, "stream": stream}
    with httpx.Client(base_url=v1_server.url, timeout=60) as http:
        # loaded first, so the request below is generating when the client leaves
        http.post("/v1/chat/completions", json={**body, "max_tokens": 1, "stream": False})
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                next(r.iter_lines())
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json=body, timeout=1.0)
    runner = v1_server.services.residency.runners()["endless:latest"]
    deadline = time.monotonic() + 5
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(runner.socket))) as rc:
        while rc.get("http://runner/stats").json()["running"]:
            assert time.monotonic() < deadline, "the runner kept generating after the client left"
            time.sleep(0.05)
