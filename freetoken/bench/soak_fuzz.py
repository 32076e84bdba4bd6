"""`freetoken bench soak fuzz`: thousands of generated requests over every endpoint's schema
(freetoken/bench/fuzz.py) against a real server, counting answers that are a 5xx, an error
not in the API's own shape, or a reset connection; then the same greedy chat as before the
fuzz must answer identically.

Pulls and pushes go to a registry of its own on loopback (empty at first: a valid pull is
a quick 404 until some case has made and pushed the model it names).

A case still answering after `--case-seconds` is cut and counted as such, not as a failure:
`num_predict: -1` runs to the end of the context, as Ollama's does, and a few of those fill
every slot of the model for minutes on a small CPU; hanging up ends them (a client that
goes away costs only its own request), so the run stays bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from freetoken import config
from freetoken.bench import fuzz
from freetoken.bench.served import free_port, wait_ready
from freetoken.bench.soak import reference_chat, serving

__all__ = ["registry", "run"]

_EXAMPLES = 8  # failures shown in the report
_CUT = "cut"  # still answering at the case's deadline


@contextlib.contextmanager
def registry(root: Path, log: Path) -> Iterator[str]:
    """The bundled registry (`python -m freetoken.registry serve`) on a free loopback port."""
    port = free_port()
    serve = ["serve", "--root", str(root), "--port", str(port)]
    cmd = [sys.executable, "-m", "freetoken.registry", *serve]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, env=config.child_environment({}), stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url + "/v2/", "the registry", log, 30)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _send(client: httpx.Client, c: fuzz.Case, seconds: float) -> tuple[str | None, int, str]:
    """(what was wrong, status, the start of the body) for one case."""
    deadline = time.monotonic() + seconds
    try:
        with client.stream(c.method, c.path, content=c.content, headers=c.headers) as r:
            chunks = []
            for chunk in r.iter_bytes():
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    return _CUT, r.status_code, "still answering"
    except httpx.TransportError as e:
        return "reset", 0, type(e).__name__
    content = b"".join(chunks)
    wrong = fuzz.verdict(c, r.status_code, r.headers.get("content-type", ""), content)
    return wrong, r.status_code, content[:160].decode(errors="replace")


def _fuzz(url: str, args: argparse.Namespace) -> dict[str, Any]:
    cases = list(fuzz.cases(random.Random(args.seed), args.requests))
    statuses: Counter[str] = Counter()
    wrong: Counter[str] = Counter()
    examples: list[str] = []
    limits = httpx.Limits(max_connections=args.concurrency)
    t0 = time.monotonic()
    with (
        httpx.Client(base_url=url, timeout=300, limits=limits) as client,
        ThreadPoolExecutor(args.concurrency) as pool,
    ):
        answers = pool.map(lambda c: _send(client, c, args.case_seconds), cases)
        for c, (what, status, text) in zip(cases, answers):
            statuses[f"{status // 100}xx" if status else "none"] += 1
            if what == _CUT:
                wrong[_CUT] += 1
            elif what:
                wrong[what] += 1
                if len(examples) < _EXAMPLES:
                    examples.append(f"{what}: {c.method} {c.path} [{c.how}] -> {status} {text!r}")
    return {
        "requests": len(cases),
        "seconds": round(time.monotonic() - t0, 1),
        "answers": dict(sorted(statuses.items())),
        "5xx": wrong["5xx"],
        "wrong shape": wrong["shape"],
        "reset": wrong["reset"],
        f"cut at {args.case_seconds:g} s (still answering)": wrong[_CUT],
        "examples": examples,
    }


def run(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    with registry(work / "fuzz-registry", work / "registry.log") as reg:
        with serving(work, {"FREETOKEN_REGISTRY": reg, **env}) as server:
            before = reference_chat(server.url)
            figures = _fuzz(server.url, args)
            after = reference_chat(server.url)
    return figures | {"same answer after": before == after, "answer": before[:60]}
