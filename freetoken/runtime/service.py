"""One loaded model as a service: loading, submitting requests, relaying their output.

Handlers run on the runner's event loop; the engine runs on its own thread and hands
output back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import tempfile
import logging
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from freetoken import options as opts
from freetoken.config import parse_size
from freetoken.chat import template as chat_template
from freetoken.chat.output import OutputParser, style_for
from freetoken.moe import elastic
from freetoken.runtime import loader
from freetoken.runtime.engine import Engine
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.prompt import PromptBuilder, PromptError
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from freetoken.runtime.tokenizer import Tokenizer

log = logging.getLogger("freetoken.runner")


class RequestError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Handle:
    seq: Sequence
    queue: asyncio.Queue
    prompt_tokens: int
    kind: str
    parser: OutputParser | None = None  # None: raw text, passed through as content
    t_start: int = field(default_factory=time.perf_counter_ns)

    async def events(self):
        while True:
            event = await self.queue.get()
            yield event
            if event.get("done") or "error" in event:
                return


class ModelService:
    def __init__(self, spec: dict[str, Any], cfg: Any):
        self.spec, self.cfg = spec, cfg
        self.files = {name: Path(p) for name, p in spec["files"].items()}
        self._scratch = tempfile.TemporaryDirectory(prefix="freetoken-runner-")
        self.files = loader.with_gguf_metadata(self.files, Path(self._scratch.name))
        self.num_ctx = int(spec.get("num_ctx") or 4096)
        self.num_parallel = int(spec.get("num_parallel") or cfg.num_parallel)
        self.status, self.error = "loading", None
        self.engine: Engine | None = None
        self.builder: PromptBuilder | None = None
        self.load_ns = 0
        self.total_bytes = sum(p.stat().st_size for p in self.files.values() if p.exists())
        self.loaded_bytes = 0
        self.sizes: dict[str, int] = {}
        self.watcher: elastic.Watcher | None = None
        self.ceiling = 0

    # --- engine thread ---------------------------------------------------------------
    def load_and_run(self) -> None:
        try:
            self._load()
        except Exception as e:  # reported through /health; the server shows the message
            log.error("load failed: %s", traceback.format_exc())
            self.status, self.error = "error", f"{type(e).__name__}: {e}"
            return
        self.status = "ok"
        self._start_watcher()
        self._run()

    def _load(self) -> None:
        t0 = time.perf_counter_ns()
        if self.cfg.cpu_threads:
            torch.set_num_threads(self.cfg.cpu_threads)
        loaded = loader.load(self.files, self.cfg.device, self.cfg.dtype, progress=self._progress)
        tokenizer = Tokenizer(self.files)
        model = loaded.model
        a = model.args
        page = self.cfg.kv_page_size
        pages = (-(-self.num_ctx // page)) * self.num_parallel
        kv = KVCache(a.num_hidden_layers, pages, page, a.num_key_value_heads, a.head_dim,
                     loaded.dtype, loaded.device)
        self.experts = loader.place_experts(loaded, self._placement())
        self.engine = Engine(model, tokenizer, kv, loaded.device, self.num_ctx, self.num_parallel,
                             self.cfg.prefill_chunk)
        self.builder = PromptBuilder(tokenizer, self.spec.get("template"))
        self.load_ns = time.perf_counter_ns() - t0
        dense = sum(p.numel() * p.element_size() for p in model.parameters())
        on_gpu = loaded.device.type == "cuda"
        cache = self.experts.cache
        self.sizes = {"size": dense + self.experts.banks.total_bytes + kv.bytes,
                      "size_vram": torch.cuda.memory_allocated(loaded.device) if on_gpu else 0,
                      "kv_cache_bytes": kv.bytes,
                      "expert_cache_bytes": cache.capacity * cache.expert_bytes if cache else 0}
        log.info("ready: %d KV pages of %d tokens (%.1f MiB)", pages, page, kv.bytes / 2**20)

    def _placement(self) -> loader.Placement:
        opts_ = self.spec.get("options") or {}
        budget = opts_.get("vram_budget")
        return loader.Placement(policy=str(opts_.get("moe_policy") or self.cfg.moe_policy),
                                vram_budget=parse_size(str(budget)) if budget else self.cfg.vram_budget,
                                cache_dir=self.cfg.cache_dir, slots=self.cfg.expert_slots)

    def _start_watcher(self) -> None:
        """Automatic cache sizing where the cache lives on a GPU others may share."""
        cache = self.experts.cache
        if cache is None or self.engine.device.type != "cuda" or not self.cfg.cache_auto:
            return
        self.ceiling = cache.capacity
        dev = self.engine.device
        self.watcher = elastic.Watcher(
            free_bytes=lambda: torch.cuda.mem_get_info(dev)[0], capacity=lambda: self.experts.cache.capacity,
            floor=self.experts.floor, ceiling=lambda: self.ceiling, headroom=self.cfg.cache_headroom,
            expert_bytes=cache.expert_bytes,
            resize=lambda n: self.engine.call_between_steps(lambda: self.experts.resize(n)).result(60)).start()

    async def resize(self, body: dict[str, Any]) -> dict[str, Any]:
        """A manual resize ({"slots": n} or {"size": "12GiB" | bytes}); it also becomes the ceiling."""
        if self.status != "ok":
            raise RequestError(f"model is not ready ({self.status})", 503)
        if self.experts.cache is None:
            raise RequestError("this model has no GPU expert cache: every expert runs on the CPU")
        try:
            if body.get("slots") is not None:
                slots = int(body["slots"])
            else:
                size = body.get("size")
                nbytes = size if isinstance(size, int) else parse_size(str(size))
                slots = nbytes // self.experts.cache.expert_bytes
        except (TypeError, ValueError) as e:
            raise RequestError(f"invalid size: {e}") from None
        fut = self.engine.call_between_steps(lambda: self.experts.resize(slots))
        try:
            result = await asyncio.wrap_future(fut)
        except ValueError as e:
            raise RequestError(str(e)) from None
        self.ceiling = result["slots"]
        return {**result, **self.experts.stats()["cache"]}

    def _progress(self, done: int, total: int) -> None:
        self.loaded_bytes, self.total_bytes = done, total

    def _run(self) -> None:
        engine = self.engine
        while True:
            engine.wait_for_work(timeout=1.0)
            try:
                engine.step()
            except Exception as e:
                log.error("step failed: %s", traceback.format_exc())
                if isinstance(e, torch.cuda.OutOfMemoryError) or "CUDA" in str(e):
                    raise SystemExit(1)  # the device state cannot be trusted; let the server restart us
                engine.fail_all(f"{type(e).__name__}: {e}")

    # --- event loop ------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        if self.status == "ok":
            return {"status": "ok", "info": {"load_duration": self.load_ns, "num_ctx": self.num_ctx,
                                             "device": str(self.engine.device), **self.sizes}}
        if self.status == "error":
            return {"status": "error", "error": self.error}
        return {"status": "loading", "progress": {"completed": self.loaded_bytes, "total": self.total_bytes}}

    def stats(self) -> dict[str, Any]:
        out = {"status": self.status, **(self.engine.stats() if self.engine else {})}
        if self.engine is not None:
            out["experts"] = self.experts.stats()
        return out

    def capabilities(self, req: dict[str, Any]) -> list[str]:
        return chat_template.capabilities(req.get("template") or self.builder.template)

    def start(self, req: dict[str, Any], loop: asyncio.AbstractEventLoop) -> Handle:
        if self.status != "ok":
            raise RequestError(f"model is not ready ({self.status})", 503)
        if req.get("format"):
            raise RequestError('structured outputs ("format") are not supported yet')
        if req.get("think") and "thinking" not in self.capabilities(req):
            raise RequestError(f'"{self.spec.get("name", "model")}" does not support thinking')
        try:
            options = opts.validate(req.get("options"))
        except opts.OptionError as e:
            raise RequestError(str(e)) from None
        num_ctx = min(int(options.get("num_ctx") or self.num_ctx), self.num_ctx)
        try:
            prompt = self.builder.build(req, num_ctx)
        except (PromptError, chat_template.TemplateError) as e:
            raise RequestError(str(e)) from None
        params = SamplingParams.from_options(options)
        room = num_ctx - len(prompt.ids)
        max_new = room if params.num_predict < 0 else min(room, params.num_predict)
        tok = self.engine.tokenizer
        # a stop string that is a whole (control) token stops on the token: it decodes to no text
        seq = Sequence(prompt.ids, params, max_new, tok.eos_ids | tok.special_ids(params.stop))
        handle = Handle(seq, asyncio.Queue(), len(prompt.ids), req.get("kind", "chat"),
                        self._parser(req, prompt.text))

        def on_output(s: Sequence, text: str, finished: bool) -> None:
            for event in self._events(handle, text, finished):
                loop.call_soon_threadsafe(handle.queue.put_nowait, event)

        if max_new <= 0:
            seq.finish_reason = "length"
            handle.queue.put_nowait(self._done_event(handle))
        else:
            self.engine.submit(seq, on_output)
        return handle

    def _parser(self, req: dict[str, Any], prompt_text: str) -> OutputParser | None:
        """How this model's output splits into content, thinking and tool calls (not for raw)."""
        if req.get("raw"):
            return None
        style = style_for(req.get("template") or self.builder.template)
        # a prompt that ends inside an opened thinking section means the answer starts there
        opened = bool(style.think_open) and prompt_text.rstrip().endswith(style.think_open)
        return OutputParser(style, tools=bool(req.get("tools")), thinking=opened,
                            show_thinking=req.get("think") is not False)

    def _events(self, handle: Handle, text: str, finished: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if handle.parser is None:
            out += [{"content": text}] if text else []
        else:
            out += handle.parser.feed(text) if text else []
            out += handle.parser.finish() if finished else []
        if finished:
            if handle.seq.finish_reason == "error":
                out.append({"error": handle.seq.error or "generation failed"})
            elif handle.seq.finish_reason != "abort":
                out.append(self._done_event(handle))
        return out

    def _done_event(self, handle: Handle) -> dict[str, Any]:
        seq = handle.seq
        return {
            "done": True,
            "done_reason": seq.finish_reason or "stop",
            "prompt_eval_count": handle.prompt_tokens,
            "prompt_eval_duration": seq.prefill_ns,
            "eval_count": len(seq.output_ids),
            "eval_duration": seq.decode_ns,
            "context": seq.prompt_ids + seq.output_ids,
        }

    def cancel(self, handle: Handle) -> None:
        if not handle.seq.is_finished and self.engine is not None:
            self.engine.abort(handle.seq.id)
