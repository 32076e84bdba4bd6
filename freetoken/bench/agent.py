"""`freetoken bench agent`: replays a coding agent's session against a running server and
shows, turn by turn, how much of each prompt was computed again.

Each request goes through `/api/chat` as an agent sends it (the whole history, the tools,
streamed); the server's done line says how many prompt tokens it evaluated and how many it
took from the prefix cache. The prompt is also rendered and tokenized here, from the model's
own files in the local store, to count the tokens that are new to this turn: those after
the first place where this prompt's token ids differ from the last one's. The goal is a
re-prefill of at most 1.1 × the new tokens on every turn. With the baseline on, each turn is
sent once more with `cache_prompt: false`, for the time to first token of a full prefill.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from freetoken.bench import common, served
from freetoken.bench.agent_session import Session, session
from freetoken.protocol import CompletionRequest
from freetoken.runtime import loader
from freetoken.runtime.prompt import PromptBuilder
from freetoken.runtime.tokenizer import Tokenizer
from freetoken.store import Store

GOAL = 1.1  # re-prefilled tokens per new token, at most

COLUMNS = [
    ("turn", "turn"),
    ("prompt", "prompt"),
    ("new", "new"),
    ("prefilled", "re-prefilled"),
    ("cached", "cached"),
    ("ratio", "/new"),
    ("ttft_ms", "TTFT ms"),
    ("ttft_full_ms", "full ms"),
    ("speedup", "x"),
    ("note", "note"),
]


class LocalPrompts:
    """The prompt token ids the server's runner builds for a chat, from the store's files."""

    def __init__(self, store: Store, name: str, scratch: Path):
        view = store.resolve(name)
        files = {k: Path(v) for k, v in store.runner_files(view).items()}
        files = loader.with_gguf_metadata(files, scratch)
        self.builder = PromptBuilder(Tokenizer(files), view.template)
        self.thinks = "thinking" in store.capabilities(view)

    def ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], num_ctx: int):
        req = CompletionRequest(
            kind="chat", messages=messages, tools=tools, think=True if self.thinks else None
        )
        return self.builder.build(req, num_ctx).ids


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def chat(client: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(seconds to the first streamed token, the done line) of one streamed /api/chat."""
    t0, first = time.perf_counter(), None
    with client.stream("POST", "/api/chat", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"/api/chat answered {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line:
                continue
            msg = json.loads(line)
            if "error" in msg:
                raise SystemExit(f"/api/chat failed: {msg['error']}")
            first = first if first is not None else time.perf_counter() - t0
            if msg.get("done"):
                return first, msg
    raise SystemExit("/api/chat ended without a done line")


def replay(args: argparse.Namespace, s: Session, prompts: LocalPrompts) -> list[dict[str, Any]]:
    """args: url, model, num_ctx, num_predict, turns, baseline, timeout."""
    rows, history, last = [], [], []
    url = args.url
    options = {"temperature": 0, "num_predict": args.num_predict, "num_ctx": args.num_ctx}
    with httpx.Client(base_url=url, timeout=args.timeout) as client:
        history.append({"role": "system", "content": s.system})
        for i, step in enumerate(s.steps[: args.turns or None]):
            if step.edit is not None:
                history[step.edit[0]] = step.edit[1]
            history += step.add
            body = {"model": args.model, "messages": history, "tools": s.tools, "stream": True}
            body |= {"think": True} if prompts.thinks else {}
            ttft, done = chat(client, body | {"options": options})
            ids = prompts.ids(history, s.tools, args.num_ctx)
            new = len(ids) - _common(ids, last)
            row = {
                "turn": i + 1,
                "prompt": len(ids),
                "new": new,
                "prefilled": done["prompt_eval_count"],
                "cached": done.get("prompt_cached_count", 0),
                "ttft_ms": ttft * 1e3,
                "note": step.note,
            }
            row["ratio"] = row["prefilled"] / max(new, 1)
            if args.baseline:
                full, again = chat(client, body | {"options": options | {"cache_prompt": False}})
                row |= {"ttft_full_ms": full * 1e3, "speedup": full / max(ttft, 1e-9)}
                row["server_prompt"] = again["prompt_eval_count"]
            rows.append(row)
            print(f"# turn {row['turn']}: {json.dumps(row)}", flush=True)  # progress
            history.append(step.reply)
            last = ids
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    met = sum(r["ratio"] <= GOAL for r in rows)
    prefilled, prompt = sum(r["prefilled"] for r in rows), sum(r["prompt"] for r in rows)
    out = [
        f"goal (re-prefilled <= {GOAL} x new) met on {met} of {len(rows)} turns; "
        f"{prefilled} of {prompt} prompt tokens computed ({prefilled / max(prompt, 1):.3f})"
    ]
    later = [r for r in rows[1:] if "speedup" in r]
    if later:
        ttft = sum(r["ttft_ms"] for r in later) / len(later)
        full = sum(r["ttft_full_ms"] for r in later) / len(later)
        out.append(
            f"turns 2-{len(rows)}: mean TTFT {ttft:.0f} ms with the prefix cache, "
            f"{full:.0f} ms re-prefilling everything ({full / max(ttft, 1e-9):.1f}x)"
        )
    off = [r for r in rows if "server_prompt" in r and r["server_prompt"] != r["prompt"]]
    if off:
        out.append(f"warning: the local prompt differs from the server's on {len(off)} turns")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="freetoken bench agent", description=__doc__.split("\n\n")[0])
    served.add_arguments(p)
    p.add_argument("--num-ctx", type=int, default=32768, help="context length requested")
    p.add_argument("--num-predict", type=int, default=16, help="tokens generated a turn")
    p.add_argument("--turns", type=int, default=0, help="replay only the first N (0: all)")
    p.add_argument("--seed", type=int, default=0, help="the session's seed")
    p.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip sending each turn again without the cache (halves the run)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    with (
        served.target(args) as (args.url, args.model, store),
        tempfile.TemporaryDirectory(prefix="freetoken-bench-agent-") as scratch,
    ):
        prompts = LocalPrompts(store, args.model, Path(scratch))
        rows = replay(args, session(args.seed), prompts)
    head = common.header("agent") | {"model": args.model}
    common.emit(rows, COLUMNS, args.json, head)
    print(summary(rows))
