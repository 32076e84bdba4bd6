"""One loaded model as a service: its load, the requests it serves, their output.

Handlers run on the runner's event loop; the engine runs on its own thread and hands output
back with `call_soon_threadsafe`. Loading is runtime/load.py, building a request into a
sequence runtime/requests.py, formatting its output runtime/events.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from freetoken import dist
from freetoken import options as opts
from freetoken.config import parse_size
from freetoken.moe import elastic
from freetoken.protocol import CompletionRequest, error_event
from freetoken.runtime import embed as embedding
from freetoken.runtime import loader
from freetoken.runtime.events import Handle
from freetoken.runtime.load import ModelLoad, Serving
from freetoken.runtime.recent import Recent
from freetoken.runtime.requests import RequestError
from freetoken.runtime.sequence import Sequence

__all__ = ["Handle", "ModelService", "RequestError"]

log = logging.getLogger("freetoken.runner")


class ModelService:
    def __init__(self, spec: dict[str, Any], cfg: Any):
        self.spec, self.cfg = spec, cfg
        files = {name: Path(p) for name, p in spec["files"].items()}
        self._scratch = tempfile.TemporaryDirectory(prefix="freetoken-runner-")
        self.files = loader.with_gguf_metadata(files, Path(self._scratch.name))
        self.num_ctx = int(spec.get("num_ctx") or 4096)
        self.num_parallel = int(spec.get("num_parallel") or cfg.num_parallel)
        self.status, self.error = "loading", None
        self.serving: Serving | None = None
        self.total_bytes = sum(p.stat().st_size for p in self.files.values() if p.exists())
        self.loaded_bytes = 0
        self.watcher: elastic.Watcher | None = None
        self.ceiling = 0  # the cache size the watcher grows back to (the last manual resize)
        self.recent = Recent()
        self._load = ModelLoad(spec, cfg, self.files, self.num_ctx, self.num_parallel)
        # prompts are prepared here; two at once keep a long one from holding up the rest
        self._prepare_pool = ThreadPoolExecutor(2, thread_name_prefix="prepare")
        self._stopping = threading.Event()

    @property
    def engine(self):
        return self.serving.engine if self.serving is not None else None

    @property
    def experts(self):
        return self.serving.experts

    # --- engine thread ---------------------------------------------------------------
    def load_and_run(self) -> None:
        try:
            self.serving = self._load.run(self._progress, _exit_runner)
        except Exception as e:  # reported through /health; the server shows the message
            log.error("load failed: %s", traceback.format_exc())
            self.status, self.error = "error", f"{type(e).__name__}: {e}"
            if self._load.group is not None:
                self._load.group.abort("the load failed")
            return
        self.status = "ok"
        self._start_watcher()
        self._run()

    def _progress(self, done: int, total: int) -> None:
        self.loaded_bytes, self.total_bytes = done, total

    def _start_watcher(self) -> None:
        """Automatic cache sizing where the cache lives on a GPU others may share."""
        experts = self.experts
        # NOTE: it watches one GPU; with several ranks the caches are sized by hand (/resize)
        gpu = self.engine.device.type == "cuda"
        if not experts.capacity or not gpu or not self.cfg.cache_auto or self._load.group:
            return
        self.ceiling = experts.capacity
        dev = self.engine.device
        self.watcher = elastic.Watcher(
            free_bytes=lambda: torch.cuda.mem_get_info(dev)[0],
            capacity=lambda: experts.capacity,
            floor=experts.floor,
            ceiling=lambda: self.ceiling,
            headroom=self.cfg.cache_headroom,
            expert_bytes=experts.expert_bytes,
            resize=lambda n: self.engine.call_between_steps(lambda: experts.resize(n)).result(60),
        ).start()

    def stop(self) -> None:
        """Ends the engine loop after its step and stops the threads the model started. A
        runner is killed instead; a process that loaded the model itself (bench serve's
        --engine) must stop them before it exits: a thread still in a kernel call when the
        interpreter finalizes is torn down mid-frame, and the process aborts."""
        self._stopping.set()
        if self.watcher is not None:
            self.watcher.stop()

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            engine.wait_for_work(timeout=1.0)
            try:
                if engine.step() == 0:
                    self.experts.idle()  # other ranks, if any, wait without spinning on their GPUs
                elif self.recent.due(engine.decoded):
                    self.recent.sample(engine.decoded, self.experts.stats().get("cache"))
            except Exception as e:
                log.error("step failed: %s", traceback.format_exc())
                if isinstance(e, (torch.cuda.OutOfMemoryError, dist.RankDied)) or "CUDA" in str(e):
                    # the device state (or the group) cannot be trusted; let the server restart us
                    _exit_runner(f"{type(e).__name__}: {e}")
                engine.fail_all(f"{type(e).__name__}: {e}")
        engine.fail_all("the model is unloading")
        self.experts.close()

    # --- event loop ------------------------------------------------------------------
    def _ready(self) -> Serving:
        if self.status != "ok":
            raise RequestError(f"model is not ready ({self.status})", 503)
        return self.serving

    def health(self) -> dict[str, Any]:
        if self.status == "ok":
            s = self.serving
            info = {"load_duration": s.load_ns, "num_ctx": self.num_ctx}
            return {"status": "ok", "info": {**info, "device": str(s.engine.device), **s.sizes()}}
        if self.status == "error":
            return {"status": "error", "error": self.error}
        return {
            "status": "loading",
            "progress": {"completed": self.loaded_bytes, "total": self.total_bytes},
        }

    def stats(self) -> dict[str, Any]:
        out = {"status": self.status, **(self.engine.stats() if self.engine else {})}
        if self.engine is not None:
            out["experts"] = self.experts.stats()
            out["recent"] = self.recent.window()
        return out

    async def start(self, req: CompletionRequest) -> Handle:
        """Submits the request; its events arrive on the handle's queue. The prompt is
        rendered and tokenized on a worker thread, never on the loop that streams every
        other request's output."""
        s = self._ready()
        vocab = s.engine.vocab_size
        if bad := next((t for t in req.context or () if not 0 <= t < vocab), None):
            raise RequestError(f"context holds token id {bad}, not in the model's vocabulary")
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(self._prepare_pool, s.requests.prepare, req)
        seq = prepared.seq
        handle = Handle(seq, asyncio.Queue(), prepared.prompt_tokens, req.kind, prepared.parser)

        def on_output(_: Sequence, text: str, finished: bool) -> None:
            try:
                events = s.formatter.events(handle, text, finished)
            except Exception as e:  # this request's output parser: it alone fails
                failed = error_event(f"{type(e).__name__}: {e}")
                loop.call_soon_threadsafe(handle.queue.put_nowait, failed)
                raise
            for event in events:
                loop.call_soon_threadsafe(handle.queue.put_nowait, event)

        if seq.max_new_tokens <= 0:
            seq.finish_reason = "length"
            handle.queue.put_nowait(s.formatter.done(handle))
        else:
            s.engine.submit(seq, on_output)
        return handle

    async def tokenize(self, req: CompletionRequest) -> dict[str, int]:
        """How many tokens /completion would start from for `req`, before any truncation."""
        count = self._ready().requests.count
        loop = asyncio.get_running_loop()
        return {"count": await loop.run_in_executor(self._prepare_pool, count, req)}

    def cancel(self, handle: Handle) -> None:
        if not handle.seq.is_finished and self.engine is not None:
            self.engine.abort(handle.seq.id)

    async def resize(self, body: dict[str, Any]) -> dict[str, Any]:
        """A manual resize ({"slots": n} or {"size": "12GiB" | bytes}); it also becomes the
        ceiling."""
        s = self._ready()
        if not s.experts.capacity:
            raise RequestError("this model has no GPU expert cache: every expert runs on the CPU")
        try:
            if body.get("slots") is not None:
                slots = int(body["slots"])
            else:
                size = body.get("size")
                nbytes = size if isinstance(size, int) else parse_size(str(size))
                slots = nbytes // s.experts.expert_bytes
        except (TypeError, ValueError) as e:
            raise RequestError(f"invalid size: {e}") from None
        fut = s.engine.call_between_steps(lambda: s.experts.resize(slots))
        try:
            result = await asyncio.wrap_future(fut)
        except ValueError as e:
            raise RequestError(str(e)) from None
        self.ceiling = result["slots"]
        return {**result, **s.experts.stats()["cache"]}

    async def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /embed: each input's mean final hidden state, L2-normalised (unless
        `normalize` is false) and cut to `dimensions`; inputs longer than num_ctx are cut
        to it, or refused with `truncate: false`. Runs between engine steps."""
        self._ready()
        inputs = body.get("input")
        inputs = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(inputs, list) or not all(isinstance(x, str) for x in inputs):
            raise RequestError("invalid input type")
        dims = body.get("dimensions")
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 0):
            raise RequestError("dimensions must be a positive integer")
        try:
            options = opts.validate(body.get("options"))
        except opts.OptionError as e:
            raise RequestError(str(e)) from None
        num_ctx = min(int(options.get("num_ctx") or self.num_ctx), self.num_ctx)
        truncate = body.get("truncate", True) is not False
        batch = [self._embed_ids(text, num_ctx, truncate) for text in inputs]
        unit = body.get("normalize", True) is not False
        vectors = []
        for ids in batch:  # one at a time, so decoding steps run in between
            vec = await self._mean_hidden(ids)
            vectors.append(embedding.normalize(vec, dims) if unit else vec[: dims or None].tolist())
        return {"embeddings": vectors, "prompt_eval_count": sum(len(ids) for ids in batch)}

    def _embed_ids(self, text: str, num_ctx: int, truncate: bool) -> list[int]:
        ids = self.engine.tokenizer.encode(text)
        if not ids:
            raise RequestError("cannot embed empty text")
        if len(ids) > num_ctx:
            if not truncate:
                raise RequestError("the input length exceeds the context length")
            ids = ids[:num_ctx]
        return ids

    async def _mean_hidden(self, ids: list[int]) -> torch.Tensor:
        engine, chunk = self.engine, self.cfg.prefill_chunk
        while True:
            fut = engine.call_between_steps(lambda: embedding.mean_hidden(engine, ids, chunk))
            vec = await asyncio.wrap_future(fut)
            if vec is not None:
                return vec
            await asyncio.sleep(0.05)  # the KV pool is full: wait for sequences to end


def _exit_runner(why: str) -> None:
    """Ends the runner process now, from any thread (SystemExit would end only the thread):
    the server sees it exit, shows this last line, and starts a fresh runner on the next
    request."""
    log.error("%s; the runner exits", why)
    sys.stderr.flush()
    os._exit(1)
