"""Helpers to drive the engine directly in tests (no HTTP)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from freetoken.layers.context import SeqSpan, StepContext, step_context
from freetoken.runtime import loader
from freetoken.runtime.anchors import Anchoring, AnchorStore
from freetoken.runtime.engine import Engine
from freetoken.runtime.graphs import DecodeGraphs
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from freetoken.runtime.state_cache import StateCache
from freetoken.runtime.tokenizer import Tokenizer


def files_of(path: Path) -> dict[str, Path]:
    return {p.name: p for p in path.iterdir() if p.is_file()}


def make_engine(
    path: Path,
    *,
    pages: int = 64,
    page_size: int = 16,
    num_ctx: int = 512,
    max_running: int = 4,
    chunk: int = 2048,
    policy: str = "adaptive",
    slots: int = 0,
    device: str = "cpu",
    graphs: str = "",
    device_cache: str = "auto",
    cpu_lane: str = "auto",
    prefix_cache: bool = False,
    anchor_ids: frozenset[int] = frozenset(),
    dtype: str = "auto",
    overlap: bool = False,
    lookahead: str = "off",
) -> Engine:
    """anchor_ids: with the prefix cache, a hybrid model's boundary tokens (its recurrent
    state is kept after them, at prompt ends and at sequence ends)."""
    """graphs: "" none, "eager" fixed-shape decode without capture, "capture" CUDA graphs."""
    files = files_of(path)
    loaded = loader.load(files, device, dtype)
    loader.place_experts(
        loaded,
        loader.Placement(policy, 0, None, slots, device_cache, cpu_lane, lookahead=lookahead),
    )
    layout = loaded.model.kv_layout()
    kv = KVCache(layout, pages, page_size, loaded.dtype, loaded.device)
    state = StateCache.for_layout(layout, max_running, loaded.dtype, loaded.device)
    dg = (
        DecodeGraphs(
            loaded.model,
            kv,
            loaded.device,
            num_ctx,
            capture=graphs == "capture",
            max_batch=max_running,
            state=state,
        )
        if graphs
        else None
    )
    return Engine(
        loaded.model,
        Tokenizer(files),
        kv,
        loaded.device,
        num_ctx,
        max_running,
        chunk,
        dg,
        prefix_cache,
        state,
        Anchoring(AnchorStore(1 << 30), state, anchor_ids) if prefix_cache and state else None,
        overlap=overlap,
    )


def full_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one uncached forward over `ids`."""
    kv = engine.kv
    pages = kv.pool.alloc(kv.pages_for(len(ids)))
    try:
        dev = engine.device
        slots = kv.slots_of(pages, 0, len(ids), dev)
        ctx = StepContext(
            torch.arange(len(ids), device=dev),
            slots,
            [SeqSpan(0, len(ids), len(ids), slots)],
            kv,
            torch.arange(len(ids), device=dev),
        )
        with torch.inference_mode(), step_context(ctx):
            return (
                engine.model.logits(engine.model(torch.tensor(ids, device=dev), ctx.positions))
                .float()
                .cpu()
            )
    finally:
        kv.pool.release(pages)


def generate(
    engine: Engine, prompts: list[list[int]], n: int, reuse: bool = True, **params
) -> list[Sequence]:
    """Runs sequences to completion together; returns them (output in .output_ids).
    reuse=False: none of them starts from the prefix cache."""
    p = SamplingParams(**{"temperature": 0.0, **params})
    seqs = [Sequence(list(ids), p, n, frozenset()) for ids in prompts]
    for s in seqs:
        s.reuse = reuse
        engine.submit(s, lambda *_: None)
    while not all(s.is_finished for s in seqs):
        engine.step()
    return seqs


@contextlib.contextmanager
def runner_process(
    model_dir: Path,
    work: Path,
    num_ctx: int,
    timeout: float = 30,
    num_parallel: int = 2,
    options: dict | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[httpx.Client]:
    """A real runner process for `model_dir` on a Unix socket; yields a client once it is ready."""
    spec = {
        "name": "tiny:latest",
        "files": {k: str(v) for k, v in files_of(model_dir).items()},
        "num_ctx": num_ctx,
        "num_parallel": num_parallel,
        **({"options": options} if options else {}),
    }
    (work / "spec.json").write_text(json.dumps(spec))
    sock = work / "r.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "freetoken.runtime.runner",
            "--socket",
            str(sock),
            "--spec",
            str(work / "spec.json"),
        ],
        env=env,
    )
    client = httpx.Client(
        transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://runner", timeout=timeout
    )
    try:
        deadline = time.time() + 60
        while True:
            try:
                if client.get("/health").json()["status"] == "ok":
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError("runner did not become ready")
            time.sleep(0.1)
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
