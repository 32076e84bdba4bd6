"""`freetoken bench soak fuzz`: thousands of generated requests over every endpoint's schema
(freetoken/bench/fuzz.py) against a real server, counting answers that are a 5xx, an error
not in the API's own shape, or a reset connection; then the same greedy chat as before the
fuzz must answer identically.

Pulls go to an empty registry of its own on loopback, so a valid pull is a quick 404.
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
from freetoken.bench.soak import free_port, reference_chat, serving

__all__ = ["registry", "run"]

_EXAMPLES = 8  # failures shown in the report


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
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/v2/", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the registry did not start (see {log})")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _send(client: httpx.Client, c: fuzz.Case) -> tuple[str | None, int, str]:
    """(what was wrong, status, the start of the body) for one case."""
    try:
        r = client.request(c.method, c.path, content=c.content, headers=c.headers)
    except httpx.TransportError as e:
        return "reset", 0, type(e).__name__
    wrong = fuzz.verdict(c, r.status_code, r.headers.get("content-type", ""), r.content)
    return wrong, r.status_code, r.text[:160]


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
        for c, (what, status, text) in zip(cases, pool.map(lambda c: _send(client, c), cases)):
            statuses[f"{status // 100}xx" if status else "none"] += 1
            if what:
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
        "examples": examples,
    }


def run(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    with registry(work / "fuzz-registry", work / "registry.log") as reg:
        with serving(work, {"FREETOKEN_REGISTRY": reg, **env}) as server:
            before = reference_chat(server.url)
            figures = _fuzz(server.url, args)
            after = reference_chat(server.url)
    return figures | {"same answer after": before == after, "answer": before[:60]}
