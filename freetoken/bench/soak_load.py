"""`freetoken bench soak load`: N streaming clients over the four chat APIs for T seconds.

Client i speaks one API (/api/chat, /api/generate, /v1/chat/completions, /v1/messages in
turn) and sends streamed requests back to back until the time is up; a share of them hang
up after the first chunk (a client that goes away must cost only its own request). Every
few seconds a poisoned request joins them (a value that once failed a whole batch, a prompt
far past the context): it may be refused or answered, but no other stream may fail with it.

A request counts as ok when its stream ends with the API's last event (done, [DONE],
message_stop), as failed by kind otherwise ("http 503", "error event", "reset", ...), and as
lost when it ends with neither a last event nor an error. Around the load, the server's
and its runners' resident memory is read (growth across a run is what a leak looks like),
and a greedy chat is answered before and after: the same answer says the server is alive
and that nothing the load did changed what the model computes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from freetoken.bench.soak import MODEL, Server, reference_chat, serving

__all__ = ["POISONS", "run"]

APIS = ("/api/chat", "/api/generate", "/v1/chat/completions", "/v1/messages")
_PROMPT = "Tell me about the sea."
_DISCONNECTED = "disconnected"

# What once failed every stream of its batch (issue 22), and a prompt far past the context.
POISONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("temperature 1e-300", {"options": {"temperature": 1e-300}}),
    ("repeat_penalty 0", {"options": {"repeat_penalty": 0}}),
    ("temperature 1e9", {"options": {"temperature": 1e9}}),
    ("context [999999]", {"context": [999999]}),
    ("num_ctx 1", {"options": {"num_ctx": 1}}),
    ("format $ref nowhere", {"format": {"$ref": "#/nope"}}),
    ("10 MB prompt", {"prompt": "word " * 2_000_000}),
)


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    by_api: Counter[str] = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)  # whole requests that ended ok
    tokens: int = 0
    poisons: Counter[str] = field(default_factory=Counter)


def _body(api: str, num_predict: int) -> dict[str, Any]:
    msgs = [{"role": "user", "content": _PROMPT}]
    if api == "/api/chat":
        return {"model": MODEL, "messages": msgs, "options": {"num_predict": num_predict}}
    if api == "/api/generate":
        return {"model": MODEL, "prompt": _PROMPT, "options": {"num_predict": num_predict}}
    body = {"model": MODEL, "messages": msgs, "max_tokens": num_predict, "stream": True}
    if api == "/v1/chat/completions":
        body["stream_options"] = {"include_usage": True}
    return body


def _event(api: str, line: str) -> tuple[str | None, int]:
    """(how the stream ends at this line: "ok", "error event", or None; tokens it reports)."""
    if api.startswith("/api/"):
        obj = json.loads(line)
        if "error" in obj:
            return "error event", 0
        return ("ok", int(obj.get("eval_count") or 0)) if obj.get("done") else (None, 0)
    if line.startswith("event: error"):
        return "error event", 0
    if line.startswith("event: message_stop") or line == "data: [DONE]":
        return "ok", 0
    if line.startswith("data: {"):
        obj = json.loads(line[6:])
        usage = obj.get("usage") or {}
        return None, int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
    return None, 0


async def _one(client: httpx.AsyncClient, api: str, body: dict, cut: bool, t: Tally) -> str:
    t0, first, tokens = time.monotonic(), None, 0
    try:
        async with client.stream("POST", api, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return f"http {r.status_code}"
            async for line in r.aiter_lines():
                if not line:
                    continue
                first = first if first is not None else time.monotonic() - t0
                if cut:
                    return _DISCONNECTED
                end, n = _event(api, line)
                tokens += n
                if end:
                    t.tokens += tokens
                    t.ttft.append(first)
                    if end == "ok":
                        t.latency.append(time.monotonic() - t0)
                    return end
            return "lost"
    except httpx.TimeoutException:
        return "timeout"
    except httpx.TransportError:
        return "reset"


async def _client(i: int, client: httpx.AsyncClient, args: Any, deadline: float, t: Tally) -> None:
    api, rng = APIS[i % len(APIS)], random.Random(args.seed * 1000 + i)
    while time.monotonic() < deadline:
        outcome = await _one(
            client, api, _body(api, args.num_predict), rng.random() < args.disconnects, t
        )
        t.outcomes[outcome] += 1
        t.by_api[f"{api} {outcome}"] += 1


async def _poisoner(client: httpx.AsyncClient, every: float, deadline: float, t: Tally) -> None:
    i = 0
    while time.monotonic() + every < deadline:
        await asyncio.sleep(every)
        name, extra = POISONS[i % len(POISONS)]
        i += 1
        api = "/api/generate" if "prompt" in extra or "context" in extra else "/api/chat"
        body = {**_body(api, 8), **extra}
        t.poisons[f"{name}: {await _one(client, api, body, False, Tally())}"] += 1


async def _load(url: str, args: argparse.Namespace) -> Tally:
    t = Tally()
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(30.0, read=600.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        deadline = time.monotonic() + args.seconds
        tasks = [_client(i, client, args, deadline, t) for i in range(args.clients)]
        if args.poison_every > 0:
            tasks.append(_poisoner(client, args.poison_every, deadline, t))
        await asyncio.gather(*tasks)
    return t


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ranked = sorted(values)
    return round(ranked[round(q * (len(ranked) - 1))], 2)


def _figures(t: Tally, seconds: float, args: argparse.Namespace) -> dict[str, Any]:
    failed = {k: v for k, v in t.outcomes.items() if k not in ("ok", _DISCONNECTED)}
    return {
        "clients": args.clients,
        "seconds": round(seconds, 1),
        "requests": sum(t.outcomes.values()),
        "ok": t.outcomes["ok"],
        "disconnected (on purpose)": t.outcomes[_DISCONNECTED],
        "failed": sum(failed.values()),
        "failed by kind": failed,
        "lost": t.outcomes["lost"],
        "503 (queue full)": t.outcomes["http 503"],
        "tokens/s": round(t.tokens / seconds, 1),
        "ttft p50 s": _percentile(t.ttft, 0.5),
        "ttft p99 s": _percentile(t.ttft, 0.99),
        "latency p50 s": _percentile(t.latency, 0.5),
        "latency p99 s": _percentile(t.latency, 0.99),
        "by api": dict(sorted(t.by_api.items())),
        "poisoned": dict(sorted(t.poisons.items())),
    }


def _alive(server: Server, before: str) -> str:
    try:
        after = reference_chat(server.url)
    except httpx.HTTPError as e:
        return f"no ({type(e).__name__})"
    return "yes, same answer" if after == before else "yes, but a different answer"


def run(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    with serving(work, env) as server:
        # loaded first (by the reference chat), so the run measures serving, not one load
        before = reference_chat(server.url)
        rss0 = server.rss_mib()
        t0 = time.monotonic()
        tally = asyncio.run(_load(server.url, args))
        figures = _figures(tally, time.monotonic() - t0, args)
        rss1 = server.rss_mib()
        memory = {"before MiB": rss0, "after MiB": rss1, "growth MiB": round(rss1 - rss0, 1)}
        return figures | {"server and runners rss": memory, "alive": _alive(server, before)}
