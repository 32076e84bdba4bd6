"""`freetoken bench serve`: its window and bound arithmetic, and its regimes against a real
server."""

from __future__ import annotations

import argparse

import httpx
import pytest

from freetoken.bench import serve, served
from freetoken.store import Store
from tests.server.harness import LiveServer, add_model, make_config


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    add_model(Store(root), "tiny")
    with LiveServer(make_config(root)) as srv:
        yield srv.url


def test_every_regime_runs_through_both_apis(url):
    args = argparse.Namespace(
        url=url,
        model="tiny",
        regimes="hot,uniform,agent,first",
        streams="1,2",
        api="openai,ollama",
        tokens=12,
        repeats=1,
        prompt_tokens=300,
        dense_ms=0.0,
        probe_dense=True,
        timeout=300.0,
    )
    rows = serve.run(args)
    decode = [r for r in rows if r["regime"] == "hot"]
    assert len(decode) == 2 * 2  # streams x apis
    assert all(r["tok_s"] > 0 and r["agg_tok_s"] > 0 and r["ttft_ms"] > 0 for r in decode)
    assert {r["streams"] for r in decode} == {1, 2}
    agent = [r for r in rows if r["regime"] == "agent"]
    assert [r["note"].split(":")[0] for r in agent] == [
        "long prompt",
        "follow-up",
        "same prompt again",
    ]
    assert not agent[1]["note"].startswith("follow-up: 0 of")  # the history was reused
    (first,) = [r for r in rows if r["regime"] == "first"]
    assert first["tok_s"] > 0 and "first / settled" in first["note"]


def test_a_row_is_the_median_window_after_a_warm_up_as_long(monkeypatch):
    asked = []
    monkeypatch.setattr(serve, "concurrent", lambda fn, n: asked.append(n))
    windows = [{"agg_tok_s": a, "note": "TTFT max 9 ms"} for a in (300.0, 100.0, 200.0)]
    monkeypatch.setattr(serve, "timed_window", lambda *a: windows.pop(0))
    args = argparse.Namespace(model="tiny", tokens=64, repeats=3)
    row = serve.decode_row(None, args, "hot", "openai", 4, None)
    assert asked == [4]  # one warm-up, as many streams as the windows
    assert row["agg_tok_s"] == 200.0 and not windows
    assert row["note"] == "TTFT max 9 ms; median of 3, 100-300 sum tok/s"


def test_the_aggregate_rate_spans_every_streams_tokens():
    from types import SimpleNamespace as Run

    runs = [Run(stamps=[1.0, 2.0, 3.0], tokens=3), Run(stamps=[1.5, 5.0], tokens=2)]
    assert serve.aggregate_rate(runs) == pytest.approx((5 - 1) / 4.0)  # the first not counted
    assert serve.aggregate_rate([Run(stamps=[], tokens=0)]) is None


def test_a_given_dense_step_serves_every_stream_count():
    args = argparse.Namespace(dense_ms=2.5, probe_dense=True)
    assert serve.dense_probe(None, args, [1, 4]) == {1: 2.5, 4: 2.5}


def test_embed_std_sets_the_synthetic_token_embeddings_scale(tmp_path):
    from safetensors import safe_open

    def embedding(path):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return f.get_tensor("model.embed_tokens.weight").float()

    context = served.checkpoint("tiny", 1, tmp_path, "float32")
    tokens = served.checkpoint("tiny", 1, tmp_path, "float32", embed_std=1.0)
    assert context != tokens  # two checkpoints, each written once
    hidden = embedding(context).shape[1]
    assert embedding(context).std().item() == pytest.approx(hidden**-0.5, rel=0.05)
    assert embedding(tokens).std().item() == pytest.approx(1.0, rel=0.05)


def test_a_quantized_shape_is_written_as_ftw_once(tmp_path):
    """--quantize writes the shape straight to FTW with packed experts (the 48-layer
    Qwen3-30B-A3B shape in BF16 and its FTW would not fit the disk together)."""
    out = served.checkpoint("tiny", 2, tmp_path, quantize="q4_K_M")
    assert out.name == "tiny-2l-q4_K_M" and (out / "ftw.json").exists()
    stamp = (out / "ftw.json").stat().st_mtime_ns
    assert served.checkpoint("tiny", 2, tmp_path, quantize="q4_K_M") == out
    assert (out / "ftw.json").stat().st_mtime_ns == stamp


def test_a_server_started_here_gets_a_context_for_the_long_prompts():
    assert serve.context_for_prompts([], 8000 + 256) == ["FREETOKEN_CONTEXT_LENGTH=16384"]
    assert serve.context_for_prompts(["A=1"], 100) == ["A=1", "FREETOKEN_CONTEXT_LENGTH=4096"]
    mine = ["FREETOKEN_CONTEXT_LENGTH=32768"]
    assert serve.context_for_prompts(mine, 8256) == mine


def test_the_dense_probe_times_settled_answers_at_each_stream_count(monkeypatch):
    """T_dense comes from answers after a first one (the first after a load captures the
    decode graphs and may compile kernels, which is no step time), at each stream count:
    the streams' tokens together over the time from the first token to the last."""
    from types import SimpleNamespace as Run

    calls = []

    def answer(client, model, messages, tokens, options):
        calls.append((tokens, options["moe_policy"]))
        return Run(stamps=[0.0, 0.32 * (len(calls) > 1)], tokens=tokens)

    monkeypatch.setattr(serve, "_ollama", answer)
    monkeypatch.setattr(serve, "cache_stats", lambda client, model: {"cache": {"slots": 8}})
    monkeypatch.setattr(serve, "unload", lambda client, model: None)
    args = argparse.Namespace(dense_ms=0.0, probe_dense=True, model="m")
    # 128 tokens in 0.32 s from the first: 127 steps of 2.52 ms; four streams of them
    # together, 511 tokens after the first in the same 0.32 s: a step of four tokens, 2.50 ms
    want = {1: 320 / 127, 4: 4 * 320 / 511}
    assert serve.dense_probe(None, args, [1, 4]) == pytest.approx(want)
    assert {policy for _, policy in calls} == {"resident"}
    assert [t for t, _ in calls] == [16, 16, 128] + [16] * 4 + [128] * 4


def test_an_answer_cut_by_an_error_is_reported_not_counted_as_empty():
    """A stream the server ends with an error (its own shape on each API) is named in the
    row's note, where it would otherwise read as an answer of no tokens."""
    sse = 'data: {"choices":[{"delta":{"content":"Once"}}]}\n\n'
    sse += 'data: {"error":{"message":"the runner failed","type":"server_error"}}\n\n'
    nd = '{"message":{"content":"Once"}}\n{"error":"the runner failed"}\n'

    def reply(request):
        body = sse if request.url.path.startswith("/v1") else nd
        return httpx.Response(200, text=body)

    with httpx.Client(transport=httpx.MockTransport(reply), base_url="http://m") as client:
        for api in ("openai", "ollama"):
            out = serve.APIS[api](client, "m", serve.STORY, 8, {})
            assert out.error == "the runner failed" and out.text == "Once" and out.tokens == 0


def test_the_resident_steps_host_time_is_printed(capsys):
    """Beside T_dense, the engine thread's time a resident step (busy less waiting for the
    device) and the share of steps launched ahead, from the probe's two snapshots."""
    before = {"steps": 10, "busy_ns": 5_000_000, "wait_ns": 1_000_000, "ahead_steps": 8}
    after = {"steps": 110, "busy_ns": 205_000_000, "wait_ns": 81_000_000, "ahead_steps": 107}
    serve._print_host(1, before, after)
    assert capsys.readouterr().out.strip() == "# resident, 1 streams: host ms 1.200, ahead 0.990"
    serve._print_host(1, before, before)  # no step between them: nothing to say
    assert capsys.readouterr().out == ""


def test_what_adaptive_measured_is_printed_after_the_rows(capsys):
    serve._print_measured(
        {
            "policy": "adaptive",
            "placement_step_ms": {"device": 1.61, "split": 1.93},
            "placement_batch": 4,
            "placement_moves": 6,
            "placement_reverted": 1,
            "placement_skipped": 4,
            "placement": "device",
        }
    )
    out = capsys.readouterr().out
    assert "device 1.61, split 1.93 (last compared at 4 streams)" in out
    assert "6 moves, 1 taken back" in out
    assert "4 skipped by the miss gate" in out
    assert "now device" in out
    # batch sizes served in a placement of their own (the keys are strings through JSON)
    serve._print_measured(
        {
            "policy": "adaptive",
            "placement": "device",
            "placement_by_batch": {"4": "split", "2": "split"},
        }
    )
    assert "now device, 2 streams split, 4 streams split" in capsys.readouterr().out
    serve._print_measured({"policy": "adaptive", "placement_step_ms": {}, "placement": "device"})
    assert "step ms by placement none; 0 moves" in capsys.readouterr().out
    serve._print_measured({"policy": "lru-pcie"})
    assert capsys.readouterr().out == ""


def test_the_share_tuners_arms_are_printed_by_batch_size(capsys):
    arms = {"best": 0.25, "step_ms": [1.5, 1.48, None], "steps": [2, 400, 0]}
    arms["behind_ms"] = [0.021, 0.0, None]
    tuner = {"arms": [0.0, 0.25, 0.5], "share": 0.25, "by_batch": {"4": arms, "1": arms}}
    serve._print_measured({"policy": "adaptive", "placement": "split", "pcie_share": tuner})
    lines = capsys.readouterr().out.splitlines()[1:]
    head = "by share (@ part of the lane's team) step ms (steps, behind ms)"
    assert lines == [
        f"# share tuner, {b} streams: serving 0.25; {head} "
        "0: 1.50 (2, +0.02), 0.25: 1.48 (400, +0.00), 0.5: - (0, -)"
        for b in (1, 4)
    ]
    # arms of half the lane's team are told apart, the one served too
    tuner |= {"arms": [0.0, 0.0, 0.25], "teams": [1.0, 0.5, 1.0]}
    arms["best_team"] = 0.5
    tuner["by_batch"] = {"1": arms | {"best": 0.0}}
    serve._print_measured({"policy": "adaptive", "placement": "split", "pcie_share": tuner})
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == (
        f"# share tuner, 1 streams: serving 0@0.5; {head} "
        "0: 1.50 (2, +0.02), 0@0.5: 1.48 (400, +0.00), 0.25: - (0, -)"
    )
