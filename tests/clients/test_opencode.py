"""OpenCode (npm `opencode-ai`, a native binary) runs one agent turn with a tool call against
the server, through its OpenAI-compatible provider (`@ai-sdk/openai-compatible`, /v1).

The tool is the MCP probe (`mcp_probe.mjs`), the only tool OpenCode is allowed to offer: its
one argument is an enum, so the forced call is short and always valid, and it runs nothing
but a directory listing.

Working offline, and leaving the machine alone (found in the package: the binary's help and
its environment switches; the npm package ships no docs):
- HOME and the XDG folders point into a temporary folder; the configuration is inline JSON in
  OPENCODE_CONFIG_CONTENT, and OPENCODE_DISABLE_PROJECT_CONFIG keeps `opencode.json` files
  of parent folders out.
- OPENCODE_DISABLE_MODELS_FETCH: no download of the models.dev catalog (a provider with its
  own `models` list needs none). OPENCODE_DISABLE_AUTOUPDATE, OPENCODE_DISABLE_SHARE,
  OPENCODE_DISABLE_LSP_DOWNLOAD: no update check, session sharing or language-server
  downloads.
- OPENCODE_PURE: no external plugins, so it does not `npm install @opencode-ai/plugin` into
  its config folder at start. It still looks up a few package versions on the npm registry;
  npm_config_registry points those at a closed loopback port, where they fail at once and
  the run goes on without them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.clients.harness import (
    MCP_PROBE,
    isolated_env,
    node_path,
    npm_install,
    probe_calls,
    run,
)
from tests.server.harness import free_port

OPENCODE = "opencode-ai@1.18.33"
TOOL = "probe_list_dir"  # OpenCode names MCP tools <server>_<tool>


@pytest.fixture(scope="module")
def opencode(tools_root):
    prefix = npm_install(tools_root, "opencode", [OPENCODE])
    binary = prefix / "node_modules" / ".bin" / "opencode"
    probe = run(
        [str(binary), "--version"], cwd=prefix, env=isolated_env(prefix / "home"), timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(f"the installed opencode binary does not run here: {probe.stderr[-500:]}")
    assert probe.stdout.strip() == OPENCODE.split("@")[1]
    return binary


def _config(url: str, node: str, probe_log: str) -> dict:
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "freetoken": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "FreeToken",
                "options": {"baseURL": f"{url}/v1"},
                "models": {
                    # limit.output becomes max_tokens, which overrides the model's num_predict
                    "agent": {
                        "name": "agent",
                        "tool_call": True,
                        "limit": {"context": 65536, "output": 512},
                    },
                    "tiny": {"name": "tiny", "limit": {"context": 65536, "output": 8}},
                },
            }
        },
        "model": "freetoken/agent",
        "small_model": "freetoken/tiny",  # the session title: a few tokens are enough
        "mcp": {
            "probe": {
                "type": "local",
                "command": [node, str(MCP_PROBE)],
                "environment": {"PROBE_LOG": probe_log},
            }
        },
        "tools": {"*": False, "probe_*": True},
        # the stock system prompt is about 10k tokens; a short one keeps the test fast
        "agent": {"build": {"prompt": "You are a test agent. Use the tools you have."}},
        "autoupdate": False,
        "share": "disabled",
    }


def _run_opencode(opencode, served, tmp_path) -> tuple[list[dict], Path]:
    """One `opencode run` in a project of one file: its JSON events and the probe's log."""
    work = tmp_path / "project"
    work.mkdir()
    (work / "hello.txt").write_text("hi\n")
    probe_log = tmp_path / "probe.jsonl"
    config = _config(served.url, node_path(), str(probe_log))
    env = isolated_env(
        tmp_path / "home",
        OPENCODE_CONFIG_CONTENT=json.dumps(config),
        OPENCODE_DISABLE_PROJECT_CONFIG="1",
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_SHARE="1",
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
        OPENCODE_PURE="1",
        npm_config_registry=f"http://127.0.0.1:{free_port()}/",
    )
    prompt = "List the files in this directory."
    cmd = [str(opencode), "run", "-m", "freetoken/agent", "--format", "json", prompt]
    done = run(cmd, cwd=work, env=env, timeout=300)
    assert done.returncode == 0, f"stdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return events, probe_log


def _streamed_calls(chunks: list[dict]) -> tuple[list[dict], list[str]]:
    """The tool-call deltas of a streamed answer and its finish reasons."""
    deltas = [c for ch in chunks for c in ch["choices"]]
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
    return calls, [d["finish_reason"] for d in deltas if d.get("finish_reason")]


@pytest.mark.slow
def test_opencode_turn_with_a_tool_call(opencode, served, seen, tmp_path):
    events, probe_log = _run_opencode(opencode, served, tmp_path)

    chats = seen.on("/v1/chat/completions")
    assert chats and all(e.status == 200 for e in chats), seen.paths()
    turns = [e for e in chats if e.json().get("tools")]
    assert turns, "OpenCode never offered its tools"
    first = turns[0].json()
    assert [t["function"]["name"] for t in first["tools"]] == [TOOL]
    assert first["stream"] is True and first["model"] == "agent"
    assert first["messages"][-1]["role"] == "user"

    calls, finish = _streamed_calls(turns[0].sse())
    # the AI SDK sends tool_choice "auto", which leaves the model's "required" option in force
    assert first.get("tool_choice") in (None, "auto")
    # the call streams as one delta with the id and name, then its arguments
    assert calls[0]["function"]["name"] == TOOL and calls[0]["id"].startswith("call_")
    arguments = "".join(c["function"].get("arguments") or "" for c in calls)
    assert json.loads(arguments) == {"path": "."}
    assert finish == ["tool_calls"]

    # OpenCode ran the tool and sent its result back in the next request
    ran = probe_calls(probe_log)
    assert [(c["tool"], c["arguments"]) for c in ran] == [("list_dir", {"path": "."})]
    assert "hello.txt" in ran[0]["output"]
    used = [e["part"] for e in events if e.get("type") == "tool_use"]
    assert len(used) == 1 and used[0]["tool"] == TOOL
    assert used[0]["state"]["status"] == "completed"
    assert "hello.txt" in used[0]["state"]["output"]
    after = turns[1].json()["messages"]
    assert after[-1]["role"] == "tool" and after[-1]["tool_call_id"] == calls[0]["id"]
    assert ran[0]["output"] in str(after[-1]["content"])
    assert after[-2]["role"] == "assistant"
    assert after[-2]["tool_calls"][0]["function"]["name"] == TOOL
    # ...and the turn ended with the model's free answer
    steps = [e["part"]["reason"] for e in events if e.get("type") == "step_finish"]
    assert steps[0] == "tool-calls" and steps[-1] in ("stop", "length")
