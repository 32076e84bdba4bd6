"""One loaded model as a service: loading, submitting requests, relaying their output.

Handlers run on the runner's event loop; the engine runs on its own thread and hands
output back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from freetoken import dist
from freetoken import options as opts
from freetoken.chat import structured
from freetoken.chat import template as chat_template
from freetoken.chat.output import OutputParser, style_for
from freetoken.config import parse_size
from freetoken.kernels import cpu as cpu_kernel
from freetoken.layers import fused
from freetoken.moe import elastic
from freetoken.runtime import embed as embedding
from freetoken.runtime import loader
from freetoken.runtime.constrain import Constraint, MaskCache
from freetoken.runtime.engine import Engine
from freetoken.runtime.graphs import DecodeGraphs
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.prompt import PromptBuilder, PromptError
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from freetoken.runtime.tokenizer import Tokenizer
from freetoken.runtime.vocab import Vocab

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
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # of tokens not yet sent
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
        self.masks: MaskCache | None = None
        self.ceiling = 0
        self.group: dist.Group | None = None  # the other ranks, when the model spans several GPUs

    # --- engine thread ---------------------------------------------------------------
    def load_and_run(self) -> None:
        try:
            self._load()
        except Exception as e:  # reported through /health; the server shows the message
            log.error("load failed: %s", traceback.format_exc())
            self.status, self.error = "error", f"{type(e).__name__}: {e}"
            if self.group is not None:
                self.group.abort("the load failed")
            return
        self.status = "ok"
        self._start_watcher()
        self._run()

    def _load(self) -> None:
        t0 = time.perf_counter_ns()
        if self.cfg.cpu_threads:
            torch.set_num_threads(self.cfg.cpu_threads)
        fused.ENABLED = self.cfg.fused_kernels
        # Build the CPU expert kernel now (cached per machine), so no request waits on a compile.
        cpu_kernel.extension()
        # one rank per GPU: the others start now and load their experts while this one loads
        ranks = dist.devices(self.cfg.gpus, self.cfg.device)
        device = dist.use(ranks[0]).type
        placement = self._placement()
        if len(ranks) > 1:
            self.group = dist.launch(
                ranks, self.files, placement, self.cfg.dtype, on_death=_exit_runner
            )
        loaded = loader.load(
            self.files,
            device,
            self.cfg.dtype,
            progress=self._progress,
            experts=self.group.experts if self.group else None,
            huge_pages=self.cfg.huge_pages,
        )
        tokenizer = Tokenizer(self.files)
        model = loaded.model
        a = model.args
        page = self.cfg.kv_page_size
        pages = (-(-self.num_ctx // page)) * self.num_parallel
        kv = KVCache(model.kv_layout(), pages, page, loaded.dtype, loaded.device)
        self.experts = loader.place_experts(loaded, placement, self.group)
        graphs = None
        if loaded.device.type == "cuda" and self.cfg.cuda_graphs:
            graphs = DecodeGraphs(
                model, kv, loaded.device, self.num_ctx, max_batch=self.num_parallel
            )
        self.engine = Engine(
            model,
            tokenizer,
            kv,
            loaded.device,
            self.num_ctx,
            self.num_parallel,
            self.cfg.prefill_chunk,
            graphs,
        )
        self.builder = PromptBuilder(tokenizer, self.spec.get("template"))
        # the vocabulary as bytes, for grammars and logprobs (about a second for 150k tokens)
        self.masks = MaskCache(Vocab.from_tokenizer(tokenizer.tok, a.vocab_size))
        self.load_ns = time.perf_counter_ns() - t0
        dense = sum(p.numel() * p.element_size() for p in model.parameters())
        on_gpu = loaded.device.type == "cuda"
        experts = self.experts
        self.sizes = {
            "size": dense + experts.host_bytes + kv.bytes,
            "size_vram": (torch.cuda.memory_allocated(loaded.device) if on_gpu else 0)
            + experts.vram_elsewhere,
            "kv_cache_bytes": kv.bytes,
            "expert_cache_bytes": experts.capacity * experts.expert_bytes,
        }
        log.info("ready: %d KV pages of %d tokens (%.1f MiB)", pages, page, kv.bytes / 2**20)

    def _placement(self) -> loader.Placement:
        opts_ = self.spec.get("options") or {}
        budget = opts_.get("vram_budget")
        return loader.Placement(
            policy=str(opts_.get("moe_policy") or self.cfg.moe_policy),
            vram_budget=parse_size(str(budget)) if budget else self.cfg.vram_budget,
            cache_dir=self.cfg.cache_dir,
            slots=self.cfg.expert_slots,
            device_cache=self.cfg.device_cache,
            cpu_lane=self.cfg.cpu_lane,
        )

    def _start_watcher(self) -> None:
        """Automatic cache sizing where the cache lives on a GPU others may share."""
        experts = self.experts
        # NOTE: it watches one GPU; with several ranks the caches are sized by hand (/resize)
        if (
            not experts.capacity
            or self.engine.device.type != "cuda"
            or not self.cfg.cache_auto
            or self.group
        ):
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

    async def resize(self, body: dict[str, Any]) -> dict[str, Any]:
        """A manual resize ({"slots": n} or {"size": "12GiB" | bytes}); it also becomes the
        ceiling."""
        if self.status != "ok":
            raise RequestError(f"model is not ready ({self.status})", 503)
        if not self.experts.capacity:
            raise RequestError("this model has no GPU expert cache: every expert runs on the CPU")
        try:
            if body.get("slots") is not None:
                slots = int(body["slots"])
            else:
                size = body.get("size")
                nbytes = size if isinstance(size, int) else parse_size(str(size))
                slots = nbytes // self.experts.expert_bytes
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
                if engine.step() == 0:
                    self.experts.idle()  # other ranks, if any, wait without spinning on their GPUs
            except Exception as e:
                log.error("step failed: %s", traceback.format_exc())
                if isinstance(e, (torch.cuda.OutOfMemoryError, dist.RankDied)) or "CUDA" in str(e):
                    # the device state (or the group) cannot be trusted; let the server restart us
                    _exit_runner(f"{type(e).__name__}: {e}")
                engine.fail_all(f"{type(e).__name__}: {e}")

    # --- event loop ------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        if self.status == "ok":
            return {
                "status": "ok",
                "info": {
                    "load_duration": self.load_ns,
                    "num_ctx": self.num_ctx,
                    "device": str(self.engine.device),
                    **self.sizes,
                },
            }
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
        return out

    def capabilities(self, req: dict[str, Any]) -> list[str]:
        return chat_template.capabilities(req.get("template") or self.builder.template)

    def start(self, req: dict[str, Any], loop: asyncio.AbstractEventLoop) -> Handle:
        if self.status != "ok":
            raise RequestError(f"model is not ready ({self.status})", 503)
        if req.get("think") and "thinking" not in self.capabilities(req):
            raise RequestError(f'"{self.spec.get("name", "model")}" does not support thinking')
        try:
            options = opts.validate(req.get("options"))
            req, forced = self._resolve(req, options)
        except (opts.OptionError, structured.SchemaError) as e:
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
        try:
            seq.constraint = self._constraint(req, forced, prompt.text, seq.stop_ids)
        except structured.SchemaError as e:
            raise RequestError(str(e)) from None
        seq.top_logprobs = _top_logprobs(req)
        calls = forced is not None or not req.get("format")  # a formatted answer is content
        handle = Handle(
            seq,
            asyncio.Queue(),
            len(prompt.ids),
            req.get("kind", "chat"),
            self._parser(req, prompt.text, calls),
        )

        def on_output(s: Sequence, text: str, finished: bool) -> None:
            for event in self._events(handle, text, finished):
                loop.call_soon_threadsafe(handle.queue.put_nowait, event)

        if max_new <= 0:
            seq.finish_reason = "length"
            handle.queue.put_nowait(self._done_event(handle))
        else:
            self.engine.submit(seq, on_output)
        return handle

    def tokenize(self, req: dict[str, Any]) -> dict[str, int]:
        """How many tokens /completion would start from for `req`, before any truncation."""
        if self.status != "ok":
            raise RequestError(f"model is not ready ({self.status})", 503)
        try:
            req, _ = self._resolve(req, opts.validate(req.get("options")))  # as start() does
            # a context too large to ever truncate: the count is of the whole rendered request
            prompt = self.builder.build(req, 1 << 62)
        except (
            opts.OptionError,
            structured.SchemaError,
            PromptError,
            chat_template.TemplateError,
        ) as e:
            raise RequestError(str(e)) from None
        return {"count": len(prompt.ids)}

    async def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /embed: each input's mean final hidden state, L2-normalised (unless
        `normalize` is false) and cut to `dimensions`; inputs longer than num_ctx are cut
        to it, or refused with `truncate: false`. Runs between engine steps."""
        if self.status != "ok":
            raise RequestError(f"model is not ready ({self.status})", 503)
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

    def _resolve(
        self, req: dict[str, Any], options: dict[str, Any]
    ) -> tuple[dict[str, Any], str | None]:
        """The request as the runner serves it, and the forced tool call: None, "" (any offered
        tool) or a tool name. Thinking defaults on where the template supports it (as Ollama
        does); tool_choice "none" keeps the tools out of the prompt."""
        req = dict(req)
        if req.get("think") is None and not req.get("raw") and "thinking" in self.capabilities(req):
            req["think"] = True
        if req.get("kind") == "generate" and req.get("images"):
            raise RequestError("this model does not support images")
        mode, name = structured.tool_choice(
            req.get("tool_choice"),
            options.get("tool_choice"),
            req.get("messages"),
            req.get("tools"),
        )
        if mode == "none":
            req["tools"] = None
        return req, (name or "") if mode == "required" else None

    def _style(self, req: dict[str, Any]):
        return style_for(req.get("template") or self.builder.template)

    def _constraint(
        self, req: dict[str, Any], forced: str | None, prompt_text: str, end_ids: frozenset[int]
    ) -> Constraint | None:
        """The grammar the answer follows: a forced tool call, else the `format`, else none."""
        style = self._style(req)
        if forced is not None:
            tools = req.get("tools") or []
            key = ["call", tools, forced, style.call_open, style.call_close]
            masks = self.masks.get(
                key,
                lambda: structured.tool_call_grammar(
                    tools, forced or None, style.call_open, style.call_close
                ),
            )
        elif req.get("format"):
            masks = self.masks.get(
                ["format", req["format"]], lambda: structured.format_grammar(req["format"])
            )
        else:
            return None
        if req.get("raw") or not style.think_close:
            return Constraint(masks, end_ids)
        # the grammar applies once the thinking section (opened by the prompt, or by the
        # model's first token) has ended
        opened = prompt_text.rstrip().endswith(style.think_open)
        opening = self.engine.tokenizer.special_ids([style.think_open])
        return Constraint(
            masks,
            end_ids,
            thinking=opened,
            think_close=style.think_close.encode(),
            think_open_ids=opening if req.get("think") is not False else frozenset(),
        )

    def _parser(
        self, req: dict[str, Any], prompt_text: str, calls: bool = True
    ) -> OutputParser | None:
        """How this model's output splits into content, thinking and tool calls (not for raw).
        calls=False: an answer held to a `format` is content, even if it looks like a call."""
        if req.get("raw"):
            return None
        style = self._style(req)
        # a prompt that ends inside an opened thinking section means the answer starts there
        opened = bool(style.think_open) and prompt_text.rstrip().endswith(style.think_open)
        return OutputParser(
            style,
            tools=calls and bool(req.get("tools")),
            thinking=opened,
            show_thinking=req.get("think") is not False,
            stream_calls=bool(req.get("stream_tool_calls")),
        )

    def _logprobs(self, seq: Sequence) -> list[dict[str, Any]]:
        """The logprobs of tokens sampled since the last call, as the events carry them."""
        taken, seq.logprobs = seq.logprobs, []
        return [
            {**self._token(t, lp), "top_logprobs": [self._token(i, v) for i, v in alts]}
            if seq.top_logprobs
            else self._token(t, lp)
            for t, lp, alts in taken
        ]

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        data = self.masks.vocab.bytes[token] if token < self.masks.vocab.size else b""
        # a control token has no text; its name stands in for it
        text = (
            data.decode("utf-8", "replace")
            if data
            else (self.engine.tokenizer.tok.id_to_token(token) or "")
        )
        return {"token": text, "logprob": logprob, "bytes": list(data or text.encode())}

    def _events(self, handle: Handle, text: str, finished: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if handle.parser is None:
            out += [{"content": text}] if text else []
        else:
            out += handle.parser.feed(text) if text else []
            out += handle.parser.finish() if finished else []
        if handle.seq.top_logprobs is not None:
            # each event carries the logprobs of the tokens that led to it; tokens whose
            # text is held back (a marker, a tool call) wait for the next event
            handle.logprobs += self._logprobs(handle.seq)
            if handle.logprobs and (out or finished):
                if not out:
                    out.append({"content": ""})
                out[0]["logprobs"], handle.logprobs = handle.logprobs, []
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


def _exit_runner(why: str) -> None:
    """Ends the runner process now, from any thread (SystemExit would end only the thread):
    the server sees it exit, shows this last line, and starts a fresh runner on the next request."""
    log.error("%s; the runner exits", why)
    sys.stderr.flush()
    os._exit(1)


def _top_logprobs(req: dict[str, Any]) -> int | None:
    """How many alternatives each token's logprobs list (None: no logprobs)."""
    top = req.get("top_logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20
    ):
        raise RequestError("top_logprobs must be between 0 and 20")
    return (top or 0) if req.get("logprobs") or top else None
