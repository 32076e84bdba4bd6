"""ollama-js, the official JavaScript client (npm `ollama`), run with Node against the server.

The calls and their assertions are in `ollama_js.mjs`; here we install the package, run the
script and check, on the server's side, that the library really made those calls.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.clients.harness import HERE, isolated_env, node_major, node_path, npm_install, run

OLLAMA_JS = "ollama@0.6.4"


@pytest.fixture(scope="module")
def ollama_js(tools_root):
    node = node_path()
    if node_major(node) < 18:
        pytest.skip("ollama-js needs Node.js 18 or later (for fetch)")
    prefix = npm_install(tools_root, "ollama-js", [OLLAMA_JS])
    # Node resolves `import 'ollama'` from the script's folder, so the script runs from there.
    shutil.copy(HERE / "ollama_js.mjs", prefix / "ollama_js.mjs")
    return node, prefix


def test_ollama_js_against_the_server(ollama_js, served, seen, tmp_path):
    node, prefix = ollama_js
    env = isolated_env(tmp_path, OLLAMA_HOST=served.url)
    done = run([node, "ollama_js.mjs"], cwd=prefix, env=env, timeout=300)
    assert done.returncode == 0, f"stdout: {done.stdout}\nstderr: {done.stderr}"
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["models"] and summary["ps"] == ["agent:latest", "tiny:latest"]
    assert summary["tool_call"]["function"]["name"] == "get_weather"

    paths = set(seen.paths())
    for call in (
        "GET /api/version",
        "GET /api/tags",
        "POST /api/show",
        "GET /api/ps",
        "POST /api/generate",
        "POST /api/chat",
        "POST /api/embed",
    ):
        assert call in paths, call
    chats = seen.on("/api/chat")
    assert all(e.headers["user-agent"].startswith("ollama-js/0.6.4") for e in chats)
    # ollama-js always says whether it wants a stream; both kinds reached the server
    assert {e.json()["stream"] for e in chats} == {True, False}
    streamed = [e for e in chats if e.json()["stream"] and e.status == 200]
    assert all(e.headers.get("content-type", "").startswith("application/json") for e in chats)
    for e in streamed:
        lines = e.ndjson()
        assert lines[-1]["done"] is True and all(not c["done"] for c in lines[:-1])
    forced = [e for e in streamed if e.json()["model"] == "agent"]
    calls = [
        c for e in forced for line in e.ndjson() for c in line["message"].get("tool_calls", [])
    ]
    assert len(calls) == 1 and isinstance(calls[0]["function"]["arguments"], dict)
