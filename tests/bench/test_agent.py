"""`freetoken bench agent` against a real server: the session's shape, and what the prefix
cache reuses turn by turn."""

from __future__ import annotations

import argparse

import pytest

from freetoken.bench import agent
from freetoken.bench.agent_session import session
from freetoken.store import CreateSpec, Store
from freetoken.tools import synth
from tests.server.harness import TINY, LiveServer, make_config


def test_the_session_is_an_agents():
    s = session()
    assert len(s.steps) >= 21 and len(s.tools) >= 12
    calls = [st for st in s.steps if st.reply.get("tool_calls")]
    results = [m for st in s.steps for m in st.add if m["role"] == "tool"]
    assert len(calls) >= 20 and len(results) >= 20
    notes = {st.note for st in s.steps}
    assert {"follow-up (earlier thinking dropped)", "history edited"} <= notes
    assert session().steps[5].add == s.steps[5].add  # the same on every run


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    # the tiny model with room for the session's 16k-token prompts
    src = synth.write_qwen3_moe(
        tmp_path_factory.mktemp("src") / "tiny",
        template=synth.CHAT_TEMPLATE_THINKING,
        **{**TINY, "max_position_embeddings": 32768},
    )
    for _ in Store(root).plan_create(CreateSpec(name="tiny", from_=str(src))).run():
        pass
    with LiveServer(make_config(root, FREETOKEN_CONTEXT_LENGTH="16384")) as srv:
        yield srv, Store(root), tmp_path_factory.mktemp("scratch")


def test_each_turn_recomputes_only_what_is_new(served):
    srv, store, scratch = served
    args = argparse.Namespace(
        model="tiny",
        url=srv.url,
        num_ctx=16384,
        num_predict=4,
        turns=3,
        baseline=True,
        timeout=600.0,
    )
    prompts = agent.LocalPrompts(store, "tiny", scratch)
    rows = agent.replay(args, session(), prompts)
    assert [r["turn"] for r in rows] == [1, 2, 3]
    # the prompt rendered here is the one the server built
    assert [r["server_prompt"] for r in rows] == [r["prompt"] for r in rows], rows
    assert rows[0]["prefilled"] == rows[0]["new"] == rows[0]["prompt"]
    for r in rows[1:]:
        assert r["ratio"] <= agent.GOAL and r["cached"] + r["prefilled"] == r["prompt"]
        assert r["cached"] > 0.8 * r["prompt"]
    assert "met on 3 of 3 turns" in agent.summary(rows)
