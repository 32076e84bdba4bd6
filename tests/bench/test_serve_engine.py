"""`bench serve --engine`: the stored model decoded in this process by the runner's own
service, with the server's request options, and the server's rows set over its rows."""

from __future__ import annotations

import argparse

import pytest

from freetoken.bench import serve, serve_engine
from freetoken.store import Store
from tests.server.harness import add_model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    add_model(Store(root), "tiny")
    return serve_engine.EngineRun(root, "tiny", ["FREETOKEN_CONTEXT_LENGTH=1024"], 2)


def test_an_answer_has_the_tokens_asked_for_at_the_regimes_options(run):
    stamps = run.answer(serve.STORY, 12, {**serve.REGIMES["uniform"], "ignore_eos": True})
    assert len(stamps) >= 2 and stamps == sorted(stamps)
    assert run.service.num_ctx == 1024  # the settings given to the server's runner
    last = run.service.engine.stats()
    assert last["decoded"] >= 11


def test_rows_for_each_regime_and_stream_count(run):
    rows = serve_engine.engine_rows(run, serve.STORY, serve.REGIMES, [1, 2], 8, repeats=2)
    assert [(r["regime"], r["streams"]) for r in rows] == [
        ("hot", 1),
        ("hot", 2),
        ("uniform", 1),
        ("uniform", 2),
    ]
    assert all(r["engine_tok_s"] > 0 for r in rows)
    # the tiny model has no expert cache here (no GPU): no misses to count
    assert all("engine_misses_per_token" in r for r in rows)


def test_the_engines_snapshot_is_the_servers_cache_entry(run):
    """Misses a token come from the same /api/cache fields the server's rows read."""
    from freetoken.api.cache import summary

    shot = run.snapshot()
    assert set(shot) == set(summary("x", {}))
    assert shot["decoded"] == run.service.engine.stats()["decoded"]


def test_the_server_rows_are_set_over_the_engines(monkeypatch, run):
    monkeypatch.setattr(serve_engine, "EngineRun", lambda *a, **k: run)
    closed = []
    monkeypatch.setattr(run, "close", lambda: closed.append(True))
    monkeypatch.setattr(
        serve_engine,
        "engine_rows",
        lambda run, messages, regimes, counts, tokens, repeats: [
            {"regime": r, "streams": n, "engine_tok_s": 100.0} for r in regimes for n in counts
        ],
    )
    served = [
        {
            "regime": "hot",
            "api": "openai",
            "streams": 1,
            "agg_tok_s": 95.0,
            "misses_per_token": 2.5,
        },
        {"regime": "hot", "api": "ollama", "streams": 1, "agg_tok_s": 50.0},
        {"regime": "agent", "api": "openai", "streams": 1, "agg_tok_s": 10.0},
    ]
    args = argparse.Namespace(model="tiny", env=[], tokens=8, repeats=3)
    store = argparse.Namespace(root=None)
    (row,) = serve_engine.against_engine(args, store, served)
    assert row == {
        "regime": "hot",
        "streams": 1,
        "engine_tok_s": 100.0,
        "server_tok_s": 95.0,
        "ratio": pytest.approx(0.95),
        "server_misses_per_token": 2.5,
    }
    assert closed == [True]  # the engine stopped before the process goes on to exit
    with pytest.raises(SystemExit, match="hot and uniform"):
        serve_engine.against_engine(args, store, served[2:])


def test_close_ends_the_engine_loop(tmp_path):
    """A process that loaded the model itself stops its engine thread before it exits: one
    still inside a kernel call when the interpreter finalizes aborts the process."""
    add_model(Store(tmp_path), "tiny")
    own = serve_engine.EngineRun(tmp_path, "tiny", ["FREETOKEN_CONTEXT_LENGTH=1024"], 1)
    assert len(own.answer(serve.STORY, 4, {"temperature": 0, "ignore_eos": True})) >= 2
    own.close()
    assert not own._thread.is_alive()
