"""A scripted server behind httpx.MockTransport for the CLI's unit tests.

Only pure unit tests use it; the end-to-end tests start the real server on loopback.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import pytest

from freetoken.cli.client import Client

Route = Callable[[httpx.Request], httpx.Response] | httpx.Response


def ndjson(*objects: dict[str, Any], content: Iterable[bytes] | None = None) -> httpx.Response:
    body = (
        content
        if content is not None
        else b"".join(json.dumps(o).encode() + b"\n" for o in objects)
    )
    return httpx.Response(200, content=body, headers={"content-type": "application/x-ndjson"})


def error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": message})


class FakeAPI:
    """Answers (method, path) from a table and records every request."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Route] = {("HEAD", "/"): httpx.Response(200)}
        self.requests: list[httpx.Request] = []

    def on(self, method: str, path: str, answer: Route) -> None:
        self.routes[(method, path)] = answer

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        answer = self.routes.get((request.method, request.url.path))
        if answer is None:
            return httpx.Response(404, text="404 page not found")
        return answer(request) if callable(answer) else answer

    def bodies(self, method: str, path: str) -> list[Any]:
        return [
            json.loads(r.content)
            for r in self.requests
            if r.method == method and r.url.path == path and r.content
        ]

    def paths(self) -> list[str]:
        return [f"{r.method} {r.url.path}" for r in self.requests]


@pytest.fixture
def api() -> FakeAPI:
    return FakeAPI()


@pytest.fixture
def client(api: FakeAPI) -> Client:
    return Client("http://server.test", transport=httpx.MockTransport(api))


def scripted_input(lines: list[str]) -> tuple[Callable[[str], str], list[str]]:
    """An `input` replacement that returns `lines` in turn, then raises EOFError (Ctrl-D)."""
    pending = list(lines)
    prompts: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        if not pending:
            raise EOFError
        line = pending.pop(0)
        if isinstance(line, BaseException):
            raise line
        return line

    return read, prompts
