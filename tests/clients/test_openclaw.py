"""OpenClaw (npm `openclaw`) runs one embedded agent turn with a tool call against the
server, through its native Ollama provider (`api: "ollama"`: streamed /api/chat).

OpenClaw needs Node 24.16+ (or 26.1+); the npm package `node` ships that binary, so it is
installed next to OpenClaw and runs it. The tool is the MCP probe (`mcp_probe.mjs`), the
only tool the agent may use (`tools.allow`); its one argument is an enum, so the forced call
is short and always valid.

Configuration (from the docs in the package, `docs/providers/ollama/*.md`,
`docs/gateway/config-*.md`, `docs/tools/tool-search.md`), all in an isolated HOME:
- an explicit provider with its model list, so there is no discovery (/api/tags, /api/show);
- `tools.toolSearch: false`: OpenClaw otherwise puts tools behind `tool_search`/`tool_call`
  wrappers for local models, whose free-string arguments the random-weight model would fill
  until `maxTokens`; the MCP tool is then offered directly;
- `agents.defaults.skipBootstrap`: no workspace bootstrap files in the prompt (16k tokens
  down to about 4.6k);
- OPENCLAW_NO_AUTO_UPDATE (no update check or telemetry request), OPENCLAW_DISABLE_BONJOUR
  (no mDNS), OPENCLAW_SKIP_CHANNELS and OPENCLAW_SKIP_CRON. Nothing else goes out: the
  turn needs no network beyond the server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.clients.harness import (
    MCP_PROBE,
    isolated_env,
    npm_install,
    probe_calls,
    run,
)

NODE = "node@24.21.0"
OPENCLAW = "openclaw@2026.9.6"
TOOL = "probe__list_dir"  # OpenClaw names MCP tools <server>__<tool>


@pytest.fixture(scope="module")
def openclaw(tools_root):
    node_prefix = npm_install(tools_root, "node24", [NODE])
    node_bin = node_prefix / "node_modules" / ".bin"
    node = node_bin / "node"
    version = run(
        [str(node), "--version"],
        cwd=node_prefix,
        env=isolated_env(node_prefix / "home"),
        timeout=60,
    )
    if version.returncode != 0 or not version.stdout.startswith("v24."):
        pytest.skip(
            f"the Node 24 binary from npm `{NODE}` does not run here: "
            f"{version.stdout} {version.stderr[-500:]}"
        )
    # OpenClaw's install scripts refuse an older Node, so npm runs them with this one.
    prefix = npm_install(tools_root, "openclaw", [OPENCLAW], node_bin=node_bin)
    entry = prefix / "node_modules" / "openclaw" / "openclaw.mjs"
    return node, entry


def _config(url: str, node: str, probe_log: str, workspace: str) -> dict:
    return {
        "models": {
            "providers": {
                "ollama": {
                    "baseUrl": url,
                    "apiKey": "ollama-local",
                    "api": "ollama",
                    "models": [
                        {
                            "id": "agent",
                            "name": "agent",
                            "input": ["text"],
                            "reasoning": False,
                            "contextWindow": 65536,
                            "maxTokens": 512,
                            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                        }
                    ],
                }
            }
        },
        "agents": {
            "defaults": {
                "model": {"primary": "ollama/agent"},
                "workspace": workspace,
                "skipBootstrap": True,
            }
        },
        "mcp": {
            "servers": {
                "probe": {
                    "command": node,
                    "args": [str(MCP_PROBE)],
                    "env": {"PROBE_LOG": probe_log},
                }
            }
        },
        "tools": {"allow": ["probe__*"], "toolSearch": False},
        "update": {"checkOnStart": False},
    }


def _run_openclaw(openclaw, served, tmp_path) -> tuple[dict, Path]:
    """One `openclaw agent --local` turn in a workspace of one file: its JSON result and the
    probe's log."""
    node, entry = openclaw
    work = tmp_path / "workspace"
    work.mkdir()
    (work / "hello.txt").write_text("hi\n")
    home = tmp_path / "home"
    probe_log = tmp_path / "probe.jsonl"
    (home / ".openclaw").mkdir(parents=True)
    config = _config(served.url, str(node), str(probe_log), str(work))
    (home / ".openclaw" / "openclaw.json").write_text(json.dumps(config, indent=2))
    env = isolated_env(
        home,
        OPENCLAW_NO_AUTO_UPDATE="1",
        OPENCLAW_DISABLE_BONJOUR="1",
        OPENCLAW_SKIP_CHANNELS="1",
        OPENCLAW_SKIP_CRON="1",
    )
    env["PATH"] = f"{node.parent}:{env['PATH']}"
    prompt = "List the files in this directory."
    cmd = [
        str(node),
        str(entry),
        "agent",
        "--local",
        "--agent",
        "main",
        "--json",
        "--message",
        prompt,
    ]
    done = run(cmd, cwd=work, env=env, timeout=300)
    assert done.returncode == 0, f"stdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
    return json.loads(done.stdout), probe_log


@pytest.mark.slow
def test_openclaw_turn_with_a_tool_call(openclaw, served, seen, tmp_path):
    result, probe_log = _run_openclaw(openclaw, served, tmp_path)
    meta = result["meta"]
    assert meta["toolSummary"] == {"calls": 1, "tools": [TOOL], "failures": 0}
    assert meta["agentMeta"]["provider"] == "ollama" and meta["agentMeta"]["model"] == "agent"
    # The free answer of a random-weight model ends at end-of-text or at num_predict, as its
    # sampling falls; either is a normal end of the turn (OpenClaw reports the second as "length").
    assert meta["stopReason"] in ("stop", "length") and meta["aborted"] is False

    # The native API only: no /v1, and no discovery with an explicit model list.
    chats = seen.on("/api/chat")
    assert len(chats) == 2 and {e.path for e in seen.exchanges} == {"/api/chat"}
    first, second = (e.json() for e in chats)
    assert first["model"] == "agent" and first["stream"] is True
    assert [t["function"]["name"] for t in first["tools"]] == [TOOL]
    assert chats[0].headers["authorization"] == "Bearer ollama-local"  # sent, and ignored

    # The call streamed as one NDJSON chunk with object arguments, then a done chunk.
    lines = chats[0].ndjson()
    calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert calls == [{"function": {"name": TOOL, "arguments": {"path": "."}}}]
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"
    assert all(not line["done"] for line in lines[:-1])
    assert lines[-1]["prompt_eval_count"] > 0 and lines[-1]["eval_count"] > 0

    # OpenClaw ran the tool and sent its output back; the model then answered freely.
    ran = probe_calls(probe_log)
    assert [(c["tool"], c["arguments"]) for c in ran] == [("list_dir", {"path": "."})]
    assert "hello.txt" in ran[0]["output"]
    assert [m["role"] for m in second["messages"][-2:]] == ["assistant", "tool"]
    assert second["messages"][-2]["tool_calls"][0]["function"]["name"] == TOOL
    assert ran[0]["output"] in second["messages"][-1]["content"]
    answer = chats[1].ndjson()
    assert not any(line["message"].get("tool_calls") for line in answer)
    assert answer[-1]["done"] is True
    assert meta["stopReason"] == answer[-1]["done_reason"]  # what the server said, passed on
