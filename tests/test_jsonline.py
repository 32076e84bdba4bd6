"""Line-framed JSON survives readers that split lines as `str.splitlines` does."""

from __future__ import annotations

import json

import httpx
import pytest

from freetoken import jsonline
from freetoken.api import sse, stream

TEXT = "a\x85b\u2028c\u2029d\x0be\x1cf\n\r\tg 日本語"


@pytest.mark.parametrize(
    "frame",
    [
        lambda obj: stream.dumps(obj) + b"\n",  # NDJSON (/api/chat, /api/generate)
        lambda obj: sse.event(obj),  # SSE (/v1/...)
        lambda obj: (jsonline.dumps(obj) + "\n").encode(),  # the runner's events
    ],
    ids=["ndjson", "sse", "runner"],
)
def test_a_model_text_with_line_breaks_of_every_kind_stays_one_line(frame):
    obj = {"message": {"content": TEXT}, "done": False}
    body = frame(obj) + frame({"done": True})
    response = httpx.Response(200, content=body)
    lines = [line for line in response.iter_lines() if line]
    payloads = [line.removeprefix("data: ") for line in lines]
    assert [json.loads(p) for p in payloads] == [obj, {"done": True}]


def test_only_the_breaking_characters_are_escaped():
    assert jsonline.dumps({"t": "é\u2028"}) == '{"t":"é\\u2028"}'
    assert jsonline.dumps_bytes("\ud800") == b'"?"'
