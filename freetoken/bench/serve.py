"""`freetoken bench serve`: decode as users meet it, through the HTTP server.

Regimes (as the independent client `serve_regimes.py` drives them):
  hot      temperature 0.7: a random-weight model repeats itself, so routing has locality
  uniform  temperature 1.5, top_p 1, top_k 100000: near-random tokens, near-uniform routing
  agent    a long prompt (time to first token is its prefill), then that history, the answer
           and a short new turn (is the prefix reused?), then the first prompt again
  first    the model unloaded, then a long prompt: the first answer after a load, against
           the same request once settled
Each of hot and uniform runs at every `--streams` count (concurrent streams, aggregate
tok/s) through each `--api`, after a warm-up answer as long as the timed ones, in
`--repeats` windows (the median is the row). Per row: decode tok/s ((tokens − 1) / (last −
first token), the mean over streams, and their sum), time to first token, the cache's hits
and misses per token over the row's own window (the server's counters before and after it),
the placement adaptive chose, and the fraction of the bound computed from the window's own misses:
  bound tok/s = streams / (T_dense + misses a step × S/(B_P + B_H)),
with S/B_P and S/B_H the runner's measured per-expert costs and T_dense the step time of the
same model with every expert resident, at the same number of streams (measured here by
reloading the model resident once, where it fits; `--dense-ms` gives the one-stream step
instead, used for every count). A step of four sequences reads up to four times the experts
and attends over four caches: taken at one stream's cost, T_dense gave a four-stream bound
that counted a step of four tokens as cheap as a step of one.

`--engine` then decodes hot and uniform again in this process, the runner's own service
without the server (bench/serve_engine.py), and prints the server's sums over the engine's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from freetoken.bench import common, served
from freetoken.bench.serve_window import (
    bound,
    engine_window,
    miss_ms,
    served_in,
    share_arms,
    window,
)

REGIMES = {
    "hot": {"temperature": 0.7},
    "uniform": {"temperature": 1.5, "top_p": 1.0, "top_k": 100000},
}
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
COLUMNS = [
    ("regime", "regime"),
    ("api", "api"),
    ("streams", "streams"),
    ("tok_s", "tok/s"),
    ("agg_tok_s", "sum tok/s"),
    ("ttft_ms", "TTFT ms"),
    ("hit_rate", "hit"),
    ("misses_per_token", "miss/tok"),
    ("miss_ms", "ms/miss"),
    ("guessed_per_token", "guess/tok"),
    ("placement", "placement"),
    ("lane_ms", "lane ms"),
    ("lane_team", "lane team"),
    ("lane_gbps", "lane GB/s"),
    ("host_ms", "host ms"),
    ("ahead", "ahead"),
    ("not_ahead", "not ahead"),
    ("bound_tok_s", "bound"),
    ("ratio_to_bound", "/bound"),
    ("note", "note"),
]


@dataclass
class Stream:
    """One streamed answer: when each token arrived, and what the server counted."""

    t0: float = 0.0
    stamps: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""
    error: str = ""  # what the server sent in place of the rest of the answer

    @property
    def ttft(self) -> float | None:
        return self.stamps[0] - self.t0 if self.stamps else None

    @property
    def rate(self) -> float | None:
        if len(self.stamps) < 2 or self.tokens < 2:
            return None
        return (self.tokens - 1) / (self.stamps[-1] - self.stamps[0])


def _openai(client: httpx.Client, model: str, messages, n: int, sampling) -> Stream:
    body = {"model": model, "messages": messages, "max_tokens": n, "stream": True}
    body |= {"stream_options": {"include_usage": True}, **sampling}
    out = Stream(time.perf_counter())
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if err := d.get("error"):
                out.error = str(err.get("message", err) if isinstance(err, dict) else err)
            if usage := d.get("usage"):
                out.tokens, out.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0
                )
            delta = (d.get("choices") or [{}])[0].get("delta") or {}
            piece = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
            if piece:
                out.stamps.append(time.perf_counter())
                out.text += delta.get("content") or ""
    return out


def _ollama(client: httpx.Client, model: str, messages, n: int, sampling) -> Stream:
    options = {"num_predict": n, **sampling}
    body = {"model": model, "messages": messages, "stream": True, "options": options}
    out = Stream(time.perf_counter())
    with client.stream("POST", "/api/chat", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line:
                continue
            d = json.loads(line)
            if err := d.get("error"):
                out.error = str(err)
            msg = d.get("message") or {}
            if msg.get("content") or msg.get("thinking"):
                out.stamps.append(time.perf_counter())
                out.text += msg.get("content") or ""
            if d.get("done"):
                out.tokens = d.get("eval_count", 0)
                out.cached_tokens = d.get("prompt_cached_count", 0)
                out.prompt_tokens = d.get("prompt_eval_count", 0) + out.cached_tokens
    return out


APIS = {"openai": _openai, "ollama": _ollama}


def cache_stats(client: httpx.Client, model: str) -> dict[str, Any]:
    """The model's entry of /api/cache ({} when it is not loaded)."""
    models = client.get("/api/cache").json().get("models") or []
    return next((m for m in models if m["name"].split(":")[0] == model.split(":")[0]), {})


def concurrent(fn, n: int) -> list[Any]:
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = fn()
        except BaseException as e:  # reported after the others finish
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def decode_row(client, args, regime: str, api: str, streams: int, dense_ms) -> dict[str, Any]:
    """The median of `args.repeats` windows by summed tok/s, after a warm-up as long as a
    window: every context bucket's decode graph is captured there, not inside the first
    window (on a fresh H200 one regime read 167, 607 and 373 tok/s in three windows)."""
    ask, sampling = APIS[api], {**REGIMES[regime], "ignore_eos": True}
    # warm-up, as many streams as the window: the placement settles here too
    concurrent(lambda: ask(client, args.model, STORY, args.tokens, sampling), streams)
    rows = [
        timed_window(client, args, regime, api, streams, dense_ms)
        for _ in range(max(1, args.repeats))
    ]
    row = common.middle(rows, lambda r: r.get("agg_tok_s") or 0.0)
    if len(rows) > 1:
        sums = sorted(r.get("agg_tok_s") or 0.0 for r in rows)
        spread = f"median of {len(rows)}, {sums[0]:.0f}-{sums[-1]:.0f} sum tok/s"
        row["note"] = "; ".join(n for n in (row.get("note"), spread) if n)
    return row


def timed_window(client, args, regime: str, api: str, streams: int, dense_ms) -> dict[str, Any]:
    """One timed window: `streams` answers at once, and the server's counters around them."""
    ask, sampling = APIS[api], {**REGIMES[regime], "ignore_eos": True}
    before = cache_stats(client, args.model)
    runs = concurrent(lambda: ask(client, args.model, STORY, args.tokens, sampling), streams)
    after = cache_stats(client, args.model)
    rates = [r.rate for r in runs if r.rate]
    win = window(before, after)
    row = {"regime": regime, "api": api, "streams": streams, **win}
    row["placement"] = served_in(after, streams)
    row["shares"] = share_arms(after, streams)
    row["tok_s"] = sum(rates) / len(rates) if rates else None
    row["agg_tok_s"] = aggregate_rate(runs)
    row["ttft_ms"] = 1e3 * sum(r.ttft or 0 for r in runs) / len(runs)
    row["bound_tok_s"] = bound(after, win, streams, dense_ms)
    row["miss_ms"] = miss_ms(win, streams, row["agg_tok_s"], dense_ms)
    row["b_p_gbps"], row["b_h_gbps"] = after.get("b_p_gbps"), after.get("b_h_gbps")
    if row["bound_tok_s"] and row["agg_tok_s"]:
        row["ratio_to_bound"] = row["agg_tok_s"] / row["bound_tok_s"]
    if failed := [r.error for r in runs if r.error]:
        row["note"] = f"{len(failed)} failed: {failed[0][:80]}"
    elif not all(r.tokens for r in runs):
        row["note"] = "an answer reported no usage"
    elif streams > 1:
        # a mean hides one stream that waited (a placement move, a capture) behind others
        row["note"] = f"TTFT max {1e3 * max(r.ttft or 0 for r in runs):.0f} ms"
    if row.get("moves"):
        moved = f"{row['moves']} placement moves"
        row["note"] = f"{row['note']}; {moved}" if row.get("note") else moved
    return row


def long_prompt(tokens: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    words = "river stone lamp harbor signal copper winter orbit maple thunder quiet ledger".split()
    return " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(tokens // 3))


def agent_rows(client, args) -> list[dict[str, Any]]:
    greedy = {"temperature": 0}
    first = [{"role": "user", "content": long_prompt(args.prompt_tokens)}]
    turn1 = _openai(client, args.model, first, 32, greedy)
    second = first + [
        {"role": "assistant", "content": turn1.text or "."},
        {"role": "user", "content": "Now say it again, shorter."},
    ]
    turn2 = _openai(client, args.model, second, 32, greedy)
    again = _openai(client, args.model, first, 32, greedy)
    rows = []
    for name, s in (("long prompt", turn1), ("follow-up", turn2), ("same prompt again", again)):
        rows.append(
            {
                "regime": "agent",
                "api": "openai",
                "streams": 1,
                "tok_s": s.rate,
                "ttft_ms": 1e3 * (s.ttft or 0),
                "note": f"{name}: {s.cached_tokens} of {s.prompt_tokens} prompt tokens cached",
            }
        )
    return rows


def first_answer_row(client, args) -> dict[str, Any]:
    """Decode of the first answer after a load against the same request settled."""
    unload(client, args.model)
    msgs = [{"role": "user", "content": long_prompt(args.prompt_tokens, seed=11)}]
    sampling = {"temperature": 0, "ignore_eos": True}
    fresh = _openai(client, args.model, msgs, args.tokens, sampling)
    # settled: the median of as many answers as a row's windows (one read 410 tok/s where
    # the next server's read 646)
    rates = [
        _openai(client, args.model, msgs, args.tokens, sampling).rate
        for _ in range(max(1, args.repeats))
    ]
    settled = statistics.median(r or 0.0 for r in rates)
    ratio = (fresh.rate or 0) / settled if settled else None
    return {
        "regime": "first",
        "api": "openai",
        "streams": 1,
        "tok_s": fresh.rate,
        "ttft_ms": 1e3 * (fresh.ttft or 0),
        "note": f"settled {settled:.1f} tok/s (median of {len(rates)}); first / settled "
        f"{ratio if ratio is None else round(ratio, 3)}",
    }


def dense_probe(client, args, counts: list[int]) -> dict[int, float]:
    """T_dense (ms) at each stream count: the hot regime's step with every expert resident,
    by a reload; empty where there is no such bound."""
    if args.dense_ms:
        return {n: args.dense_ms for n in counts}
    if not args.probe_dense or not (cache_stats(client, args.model).get("cache")):
        return {}  # no GPU cache: every expert runs on the CPU, there is no such bound
    # the dense step does not depend on the expert cache's size: a capped budget (the 48-layer
    # shape at 8 GiB) would not hold every expert, so the probe asks for the device's memory
    resident = {**REGIMES["hot"], "ignore_eos": True, "moe_policy": "resident", "vram_budget": "0"}
    out = {}
    try:
        # the first answer after a load captures the decode graphs (and compiles kernels
        # on a fresh machine): measured, it read 7-13 ms a step against 2.6 settled
        _ollama(client, args.model, STORY, 16, resident)
        for n in counts:
            concurrent(lambda: _ollama(client, args.model, STORY, 16, resident), n)
            before = cache_stats(client, args.model)
            runs = concurrent(lambda: _ollama(client, args.model, STORY, 128, resident), n)
            if rate := aggregate_rate(runs):
                out[n] = n * 1e3 / rate
                _print_host(n, before, cache_stats(client, args.model))
    except httpx.HTTPStatusError as e:
        print(f"# the resident model did not load (HTTP {e.response.status_code}): no bound")
    finally:  # unloaded, so the next request loads it as served
        unload(client, args.model)
    return out


def _print_host(streams: int, before: dict, after: dict) -> None:
    """The resident step's engine-thread time, beside the regimes' `host ms`: where a
    regime's step is longer than the bound's, whether the host or the device grew."""
    steps = (after.get("steps") or 0) - (before.get("steps") or 0)
    if steps > 0 and (win := engine_window(before, after, steps)):
        print(
            f"# resident, {streams} streams: host ms {win['host_ms']:.3f}, ahead {win['ahead']:.3f}"
        )


def aggregate_rate(runs: list[Any]) -> float | None:
    """Tokens a second of concurrent streams together, first token to last: every token
    but the first counts, as one stream's rate (and the independent client's) counts."""
    stamps = [r.stamps for r in runs if r.stamps]
    if not stamps:
        return None
    first, last = min(s[0] for s in stamps), max(s[-1] for s in stamps)
    return (sum(r.tokens for r in runs) - 1) / max(last - first, 1e-9)


def unload(client: httpx.Client, model: str) -> None:
    client.post("/api/generate", json={"model": model, "keep_alive": 0}).raise_for_status()
    time.sleep(1.0)


def run(args) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
        _ollama(client, args.model, STORY, 1, {})  # loaded
        counts = [int(s) for s in args.streams.split(",")]
        dense = dense_probe(client, args, counts)
        shown = ", ".join(f"{n} streams {ms:.3f}" for n, ms in dense.items()) or "none"
        print(f"# T_dense ms: {shown}", flush=True)
        for regime in args.regimes.split(","):
            if regime in REGIMES:
                for streams in counts:
                    for api in args.api.split(","):
                        ms = dense.get(streams)
                        new = [decode_row(client, args, regime, api, streams, ms)]
                        _progress(rows, new)
            elif regime == "agent":
                _progress(rows, agent_rows(client, args))
            elif regime == "first":
                _progress(rows, [first_answer_row(client, args)])
            else:
                raise SystemExit(f"unknown regime {regime!r}")
        _print_measured(cache_stats(client, args.model))
    return rows


def _print_measured(stats: dict) -> None:
    """What adaptive measured since the load: a run long enough to explore that shows no
    placement measured means the chooser never ran (it once dropped every step as idle)."""
    if stats.get("policy") != "adaptive":
        return
    step_ms = stats.get("placement_step_ms") or {}
    measured = ", ".join(f"{m} {ms:.2f}" for m, ms in step_ms.items()) or "none"
    batch = stats.get("placement_batch")
    at = f" (last compared at {batch} streams)" if step_ms and batch else ""
    own = stats.get("placement_by_batch") or {}
    sizes = "".join(f", {b} streams {m}" for b, m in sorted(own.items(), key=lambda i: int(i[0])))
    print(
        f"# adaptive since load: step ms by placement {measured}{at}; "
        f"{stats.get('placement_moves') or 0} moves, {stats.get('placement_reverted') or 0} "
        f"taken back, {stats.get('placement_skipped') or 0} skipped by the miss gate; "
        f"now {stats.get('placement')}{sizes}",
        flush=True,
    )
    _print_shares(stats.get("pcie_share") or {})


def _print_shares(tuner: dict) -> None:
    """The share tuner's books at each batch size: the arm served, and each arm's mean
    step ms, steps, and ms a step behind the served one by paired trials (which share
    served, and on which part of the lane's team, decides split's lane work and its speed)."""
    arms = tuner.get("arms") or []
    labels = [_arm(a, t) for a, t in zip(arms, tuner.get("teams") or [1.0] * len(arms))]
    for batch, arm in sorted((tuner.get("by_batch") or {}).items(), key=lambda i: int(i[0])):
        each = zip(
            labels,
            arm.get("step_ms") or [],
            arm.get("steps") or [],
            arm.get("behind_ms") or [],
            strict=False,
        )
        told = ", ".join(f"{a}: {_ms(ms)} ({n}, {_ms(d, '+.2f')})" for a, ms, n, d in each)
        served = _arm(arm.get("best"), arm.get("best_team", 1.0))
        print(
            f"# share tuner, {batch} streams: serving {served}; by share (@ part of the lane's "
            f"team) step ms (steps, behind ms) {told}",
            flush=True,
        )


def _arm(share: float | None, team: float) -> str:
    """A share, and the part of the lane's team where not all of it."""
    if share is None:
        return "-"
    return f"{share:g}" if team >= 1 else f"{share:g}@{team:g}"


def _ms(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _progress(rows: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    """Keeps `new` and prints it at once, so a run cut short still reports what it measured."""
    rows += new
    for r in new:
        print("# row " + json.dumps(r), flush=True)


def context_for_prompts(env: list[str], tokens: int) -> list[str]:
    """A server started here gets a context long enough for the agent and first-answer
    prompts (the default 4096 would cut an 8000-token prompt, and its answer with it),
    unless `--env` sets one."""
    if any(e.startswith("FREETOKEN_CONTEXT_LENGTH=") for e in env):
        return env
    n = 4096
    while n < tokens + 512:  # room for the template and the follow-up turn
        n *= 2
    return [*env, f"FREETOKEN_CONTEXT_LENGTH={n}"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="freetoken bench serve", description=__doc__.split("\n\n")[0])
    served.add_arguments(p)
    p.add_argument("--regimes", default="hot,uniform,agent,first")
    p.add_argument("--streams", default="1,4")
    p.add_argument("--api", default="openai,ollama")
    p.add_argument("--tokens", type=int, default=256, help="tokens generated a stream")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed windows a row (its median by sum tok/s)"
    )
    p.add_argument("--prompt-tokens", type=int, default=8000, help="the agent's long prompt")
    p.add_argument("--dense-ms", type=float, default=0.0, help="T_dense at one stream, if known")
    p.add_argument("--no-probe-dense", dest="probe_dense", action="store_false")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--engine",
        action="store_true",
        help="then decode the same regimes in this process (the runner's service, no server) "
        "and print the server's figures over the engine's",
    )
    args = p.parse_args(argv)
    args.env = context_for_prompts(args.env, args.prompt_tokens + args.tokens)
    # a server of its own runs with these; one attached to says nothing of its own
    settings = {} if args.url else served.server_settings(args.env)
    with served.target(args) as (args.url, args.model, store):
        rows = run(args)
    head = common.header("serve") | {"model": args.model, "settings": settings}
    common.emit(rows, COLUMNS, args.json, head)
    if args.engine:
        from freetoken.bench import serve_engine

        compared = serve_engine.against_engine(args, store, rows)
        common.emit(compared, serve_engine.COLUMNS, args.json, head)
