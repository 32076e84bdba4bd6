"""`freetoken bench draw`: what drawing a token costs after a decode step.

Times `batch_draw.draw_rows` (what the engine calls each step) on random logits of a
vocabulary's size, one row and several, for the options users send: Ollama's defaults, the
near-uniform regime of `bench serve` (a high temperature, top_k 100000, top_p 1), no top-k,
greedy, and a large top-k with top_p ("sorted": the kernels leave it to torch). Each row prints the
GPU time a draw takes when nothing waits for it ("queued": what a step that does not read
its token pays), the time with its token read each draw ("synced"), and the same draw with
the Triton kernels off, in the same run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from freetoken.bench import common
from freetoken.layers import fused
from freetoken.runtime import batch_draw
from freetoken.runtime.sampling import SamplingParams

OPTIONS = {
    "defaults": SamplingParams(),
    "hot": SamplingParams(temperature=0.7),
    "uniform": SamplingParams(temperature=1.5, top_p=1.0, top_k=100_000),
    "no-top-k": SamplingParams(temperature=1.0, top_p=1.0, top_k=0),
    "sorted": SamplingParams(temperature=1.0, top_k=1000, top_p=0.95),
    "greedy": SamplingParams(temperature=0.0),
}


def _timer(device: torch.device) -> Callable[[Callable[[], Any], int], tuple[float, float]]:
    """(synced, queued) µs a call of fn over n calls: each result read, and none read."""

    def timed(fn: Callable[[], Any], n: int) -> tuple[float, float]:
        for _ in range(max(n // 10, 3)):
            fn()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            int(fn()[0])
        synced = (time.perf_counter() - t0) / n * 1e6
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return synced, start.elapsed_time(end) / n * 1e3

    return timed


def measure(vocab: int, rows: int, p: SamplingParams, n: int, device: torch.device) -> dict:
    g = torch.Generator(device=device).manual_seed(rows)
    scores = 3 * torch.randn(rows, vocab, device=device, generator=g)
    histories = [list(range(0, 64 * 7, 7))] * rows  # penalties see a history, as in a chat

    def once() -> list[torch.Tensor]:
        return batch_draw.draw_rows(
            scores, list(range(rows)), histories, [p] * rows, [None] * rows, 4096
        )

    timed = _timer(device)
    synced, queued = timed(once, n)
    with fused.disabled():
        _, torch_queued = timed(once, max(n // 4, 10))
    return {
        "synced_us": synced,
        "queued_us": queued,
        "torch_us": torch_queued,
        "speedup": torch_queued / queued,
    }


COLUMNS = [
    ("options", "options"),
    ("rows", "rows"),
    ("synced_us", "synced µs"),
    ("queued_us", "queued µs"),
    ("torch_us", "torch queued µs"),
    ("speedup", "torch/kernels"),
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="freetoken bench draw", description=__doc__)
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--vocab", type=int, default=151_643, help="logits a row (Qwen3's)")
    ap.add_argument("--rows", default="1,4", help="rows drawn together, comma-separated")
    ap.add_argument("--draws", type=int, default=300, help="draws timed a case")
    ap.add_argument("--options", default=",".join(OPTIONS), help="which of: " + ", ".join(OPTIONS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench draw times the GPU's draw: no CUDA device here")
    device = torch.device("cuda")
    rows = []
    for name in args.options.split(","):
        if name not in OPTIONS:
            raise SystemExit(f"unknown options {name!r}: one of {', '.join(OPTIONS)}")
        for r in (int(x) for x in args.rows.split(",")):
            got = measure(args.vocab, r, OPTIONS[name], args.draws, device)
            rows.append({"options": name, "rows": r, **got})
    common.emit(rows, COLUMNS, args.json, common.header("draw"))


if __name__ == "__main__":
    main()
