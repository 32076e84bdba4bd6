"""`bench serve --engine`: the served model decoded in this process, for the comparison.

The runner's own service (runtime.service.ModelService) loads the same model from the store
with the settings the server's runner had, and decodes the same regimes: the same prompt,
the same sampling options as /v1/chat/completions gives them, the same stream counts. What
is left out is the HTTP server, the runner process and its streaming: the server's figures
over these are what the server costs. Routing follows the sampled tokens, so the two runs
meet the same routing in distribution, not token for token.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from freetoken import options as opts
from freetoken.api.compat import sampling_options
from freetoken.bench import common, served
from freetoken.protocol import CompletionRequest
from freetoken.server.residency import default_num_ctx
from freetoken.store import Store

__all__ = ["COLUMNS", "EngineRun", "against_engine", "engine_rows"]

LOAD_TIMEOUT = 900.0


class EngineRun:
    """A model loaded by the runner's service in this process, its engine on a thread."""

    def __init__(self, store: Path, model: str, env: list[str], streams: int):
        from freetoken.runtime.service import ModelService

        cfg = served.runner_config(env)
        shelf = Store(store)
        view = shelf.resolve(model)
        merged = opts.merge(view.params, {})
        num_ctx = default_num_ctx(
            merged.get("num_ctx"), shelf.context_length(view), cfg.context_length
        )
        load = {k: merged[k] for k in sorted(opts.LOAD_OPTIONS - {"num_ctx"}) if k in merged}
        spec = {
            "name": model,
            "files": shelf.runner_files(view),
            "num_ctx": num_ctx,
            "num_parallel": max(streams, cfg.num_parallel),
            "options": load,
        }
        self.view = view
        self.service = ModelService(spec, cfg)
        self._thread = threading.Thread(target=self.service.load_and_run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + LOAD_TIMEOUT
        while self.service.status == "loading" and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.service.status != "ok":
            raise SystemExit(f"the model did not load in this process: {self.service.error}")

    def close(self) -> None:
        """Stops the engine and the threads it started, before this process exits."""
        self.service.stop()
        self._thread.join(timeout=30)

    def snapshot(self) -> dict[str, Any]:
        """The model's /api/cache entry as the server would give it (a window reads two)."""
        from freetoken.api.cache import summary

        return summary(self.view.display, self.service.stats())

    def answer(self, messages: list[dict[str, Any]], tokens: int, sampling: dict) -> list[float]:
        """One answer of `tokens` tokens: when each piece of text came out."""
        body = {**sampling, "max_tokens": tokens}
        options = opts.merge(
            self.view.params,
            sampling_options(body, max_keys=("max_tokens",), stop_key="stop", defaults=True),
        )
        serving = self.service.serving
        req = CompletionRequest(kind="chat", messages=messages, options=options)
        seq = serving.requests.prepare(req).seq
        stamps: list[float] = []
        done = threading.Event()

        def on_output(_: Any, text: str, finished: bool) -> None:
            stamps.append(time.perf_counter())
            if finished:
                done.set()

        serving.engine.submit(seq, on_output)
        done.wait()
        return stamps

    def rate(self, messages: list[dict[str, Any]], tokens: int, sampling: dict, n: int) -> float:
        """Tokens a second of n answers at once, from the first piece of text to the last
        (as `serve.aggregate_rate` counts a server's streams)."""
        out: list[list[float]] = [[] for _ in range(n)]

        def one(i: int) -> None:
            out[i] = self.answer(messages, tokens, sampling)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = min(s[0] for s in out if s)
        last = max(s[-1] for s in out if s)
        return (n * tokens - 1) / max(last - first, 1e-9)


def engine_rows(
    run: EngineRun,
    messages: list[dict[str, Any]],
    regimes: dict[str, dict[str, Any]],
    counts: list[int],
    tokens: int,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Per regime and stream count: the engine's tokens a second, summed over the streams,
    the median of `repeats` answers after one as long (graphs captured, kernels compiled),
    as the server's rows are timed; and its misses a token over those answers (where a
    server row and the engine's differ, whether the routing did)."""
    from freetoken.bench.serve_window import window

    rows = []
    for regime, sampling in regimes.items():
        sampling = {**sampling, "ignore_eos": True}
        for n in counts:
            run.rate(messages, tokens, sampling, n)
            before = run.snapshot()
            rates = [run.rate(messages, tokens, sampling, n) for _ in range(max(1, repeats))]
            seen = window(before, run.snapshot())
            rows.append(
                {
                    "regime": regime,
                    "streams": n,
                    "engine_tok_s": common.middle(rates, float),
                    "engine_misses_per_token": seen.get("misses_per_token"),
                }
            )
    return rows


COLUMNS = [
    ("regime", "regime"),
    ("streams", "streams"),
    ("server_tok_s", "server sum tok/s"),
    ("engine_tok_s", "engine sum tok/s"),
    ("ratio", "server/engine"),
    ("server_misses_per_token", "server miss/tok"),
    ("engine_misses_per_token", "engine miss/tok"),
]


def against_engine(args, store, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The server's /v1/chat/completions rows of the hot and uniform regimes over the same
    model decoded in this process."""
    from freetoken.bench.serve import REGIMES, STORY

    served_rows = {(r["regime"], r["streams"]): r for r in rows if r.get("api") == "openai"}
    regimes = {k: v for k, v in REGIMES.items() if any(k == r for r, _ in served_rows)}
    counts = sorted({n for _, n in served_rows})
    if not regimes:
        raise SystemExit("--engine compares the openai rows of the hot and uniform regimes")
    run = EngineRun(store.root, args.model, args.env, max(counts))
    try:
        engine = engine_rows(run, STORY, regimes, counts, args.tokens, args.repeats)
    finally:
        run.close()
    out = []
    for row in engine:
        served = served_rows.get((row["regime"], row["streams"]), {})
        server = served.get("agg_tok_s")
        ratio = server / row["engine_tok_s"] if server else None
        misses = served.get("misses_per_token")
        out.append(
            {**row, "server_tok_s": server, "ratio": ratio, "server_misses_per_token": misses}
        )
    return out
