"""Loading one model for a runner: threads and kernels set up, the other ranks started,
weights read, the KV pool sized, the experts placed, the decode graphs and the engine made.

`ModelLoad.run` does it on the engine thread; `group` is set as soon as other ranks exist,
so a failed load can take them down.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from freetoken import dist, doctor
from freetoken.chat import formats
from freetoken.config import parse_size
from freetoken.ftw import reader as ftw_reader
from freetoken.kernels import cpu as cpu_kernel
from freetoken.layers import fused
from freetoken.models.base import KVLayout
from freetoken.moe.backend import ExpertBackend
from freetoken.runtime import anchors, loader, sampling
from freetoken.runtime.constrain import Grammars
from freetoken.runtime.engine import Engine
from freetoken.runtime.events import EventFormatter
from freetoken.runtime.graphs import DecodeGraphs
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.prompt import PromptBuilder
from freetoken.runtime.requests import RequestBuilder
from freetoken.runtime.state_cache import StateCache
from freetoken.runtime.tokenizer import Tokenizer
from freetoken.runtime.vocab import Vocab

log = logging.getLogger("freetoken.runner")


@dataclass
class Sizes:
    """The memory a loaded model takes, as /health (and so /api/ps) reports it: computed
    when asked, since a resize of the expert cache (by hand or by the VRAM watcher) changes
    it. `size` is host and GPU memory together; `host_bytes` is what the server counts
    against host memory when it judges room for another model."""

    device: torch.device
    experts: ExpertBackend
    resident: int  # dense weights, the KV pool and recurrent state, on the compute device
    kv: int

    def __call__(self) -> dict[str, int]:
        experts = self.experts
        cache = experts.capacity * experts.expert_bytes
        if self.device.type == "cuda":
            vram = torch.cuda.memory_allocated(self.device) + experts.vram_elsewhere
            host = experts.host_bytes
        else:  # the cache is a host-memory pool beside the banks
            vram, host = 0, experts.host_bytes + self.resident + cache
        return {
            "size": host + vram,
            "size_vram": vram,
            "host_bytes": host,
            "kv_cache_bytes": self.kv,
            "expert_cache_bytes": cache,
        }


@dataclass
class Serving:
    """What a loaded model is served with."""

    engine: Engine
    experts: ExpertBackend
    requests: RequestBuilder
    formatter: EventFormatter
    load_ns: int
    sizes: Sizes  # what /health reports, computed when asked


class ModelLoad:
    def __init__(
        self,
        spec: dict[str, Any],
        cfg: Any,
        files: dict[str, Path],
        num_ctx: int,
        num_parallel: int,
    ):
        self.spec, self.cfg, self.files = spec, cfg, files
        self.num_ctx, self.num_parallel = num_ctx, num_parallel
        self.group: dist.Group | None = None  # the other ranks, when the model spans GPUs

    def run(self, progress, on_death) -> Serving:
        t0 = time.perf_counter_ns()
        cfg = self.cfg
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        fused.ENABLED = cfg.fused_kernels
        # Build the CPU expert kernel now (cached per machine), so no request waits on a compile.
        kernel = cpu_kernel.status()
        log.info("CPU experts: %s (%s)", kernel.kernel, kernel.reason)
        # one rank per GPU: the others start now and load their experts while this one loads
        ranks = dist.devices(cfg.gpus, cfg.device)
        self.log_judgement(dist.use(ranks[0]))
        device = dist.use(ranks[0]).type
        placement = self.placement()
        if len(ranks) > 1:
            # every rank reads its share into this host's memory at once: the whole must fit
            if ftw_reader.INDEX in self.files:
                index = ftw_reader.Index.load(self.files)
                ftw_reader.require_host_memory(index.total_bytes, "the model's weights")
            self.group = dist.launch(ranks, self.files, placement, cfg.dtype, on_death=on_death)
        loaded = loader.load(
            self.files,
            device,
            cfg.dtype,
            progress=progress,
            experts=self.group.experts if self.group else None,
            huge_pages=cfg.huge_pages,
        )
        layout, page = loaded.model.kv_layout(), cfg.kv_page_size
        pages = kv_pages(layout, loaded.dtype, page, self.num_ctx, self.num_parallel, cfg)
        kv = KVCache(layout, pages, page, loaded.dtype, loaded.device)
        # a state slot for each sequence that may run at once (hybrid models' recurrent layers)
        state = StateCache.for_layout(layout, self.num_parallel, loaded.dtype, loaded.device)
        experts = loader.place_experts(loaded, placement, self.group)
        # Start from a full expert cache, as `bench decode` does: an empty one makes the first
        # answer fetch every expert it meets once, and adaptive would judge the routing's
        # locality on those cold misses.
        experts.warm()
        serving = self._serving(loaded, kv, experts, cfg.prefix_cache, state)
        sampling.warm_up(int(loaded.config.get("vocab_size", 0)), loaded.device)
        serving.load_ns = time.perf_counter_ns() - t0
        log.info("ready: %d KV pages of %d tokens (%.1f MiB)", pages, page, kv.bytes / 2**20)
        if state is not None:
            log.info("%d recurrent state slots (%.1f MiB)", state.num_slots, state.bytes / 2**20)
        return serving

    def log_judgement(self, device: torch.device | None = None) -> None:
        """What `freetoken doctor MODEL` would say, so a load's log says it too."""
        name = str(self.spec.get("name", "model"))
        try:
            verdict = doctor.at_load(name, self.files, self.num_ctx, self.cfg, device)
        except (OSError, ValueError, KeyError) as e:  # a model without an FTW index
            log.info("doctor: no judgement for %s: %s", name, e)
            return
        for line in verdict.lines():
            log.log(
                logging.WARNING if line.startswith("warning") else logging.INFO, "doctor: %s", line
            )

    def placement(self) -> loader.Placement:
        """How the experts are placed: the request's load options, else the settings."""
        opts_ = self.spec.get("options") or {}
        budget = opts_.get("vram_budget")
        cfg = self.cfg
        return loader.Placement(
            policy=str(opts_.get("moe_policy") or cfg.moe_policy),
            vram_budget=parse_size(str(budget)) if budget else cfg.vram_budget,
            cache_dir=cfg.cache_dir,
            slots=cfg.expert_slots,
            device_cache=cfg.device_cache,
            cpu_lane=cfg.cpu_lane,
            model_key=self._weights_key(),
            lookahead=cfg.lookahead,
        )

    def _weights_key(self) -> str:
        """The model's weights named by their FTW index (its bytes' hash): what the expert
        cache held when they last served is kept under it."""
        if ftw_reader.INDEX not in self.files:
            return ""
        data = Path(self.files[ftw_reader.INDEX]).read_bytes()
        return hashlib.sha256(data).hexdigest()[:24]

    def _serving(
        self,
        loaded: loader.Loaded,
        kv: KVCache,
        experts: ExpertBackend,
        prefix_cache: bool,
        state: StateCache | None,
    ) -> Serving:
        model, device = loaded.model, loaded.device
        graphs = None
        if device.type == "cuda" and self.cfg.cuda_graphs:
            graphs = DecodeGraphs(
                model, kv, device, self.num_ctx, max_batch=self.num_parallel, state=state
            )
        if graphs is not None:
            _warm(graphs, kv)
        tokenizer = Tokenizer(self.files)
        prompts = PromptBuilder(tokenizer, self.spec.get("template"))
        fmt = formats.format_for(loaded.config.get("model_type"), prompts.template)
        anchoring = self._anchoring(tokenizer, fmt, state) if prefix_cache else None
        engine = Engine(
            model,
            tokenizer,
            kv,
            device,
            self.num_ctx,
            self.num_parallel,
            self.cfg.prefill_chunk,
            graphs,
            prefix_cache,
            state,
            anchoring,
            overlap=self.cfg.overlap,
        )
        # the vocabulary as bytes, for grammars and logprobs (a few seconds for 150k tokens)
        vocab = Vocab.from_tokenizer(tokenizer.tok, model.args.vocab_size, formats.MARKERS)
        requests = RequestBuilder(
            tokenizer,
            prompts,
            Grammars(vocab, tokenizer.eos_ids),
            self.num_ctx,
            architecture=loaded.config.get("model_type"),
        )
        dense = sum(p.numel() * p.element_size() for p in model.parameters())
        state_bytes = state.bytes if state is not None else 0
        sizes = Sizes(device, experts, dense + kv.bytes + state_bytes, kv.bytes)
        return Serving(engine, experts, requests, EventFormatter(vocab, tokenizer), 0, sizes)

    def _anchoring(
        self, tokenizer: Tokenizer, fmt: formats.ChatFormat, state: StateCache | None
    ) -> anchors.Anchoring | None:
        """Where a hybrid model keeps its recurrent state for reuse (None: no recurrent
        layers): after its end-of-message tokens, its chat format's single-token markers and
        the end of its thinking."""
        if state is None:
            return None
        budget = self.cfg.anchor_cache_size or anchors.default_budget()
        bounds = fmt.thinking_bounds()
        markers = tokenizer.special_ids([*fmt.markers, *(bounds[1:] if bounds else ())])
        store = anchors.AnchorStore(budget)
        log.info("anchors: up to %.0f MiB of recurrent-state checkpoints", budget / 2**20)
        return anchors.Anchoring(store, state, tokenizer.eos_ids | markers)


def kv_pages(
    layout: list[KVLayout], dtype: torch.dtype, page: int, num_ctx: int, num_parallel: int, cfg
) -> int:
    """Pages in the KV pool: from FREETOKEN_KV_CACHE_SIZE, else room for two whole contexts
    or every parallel sequence at up to 8k tokens, whichever is more. Sequences take pages
    as they grow, so one long agent and idle slots do not reserve num_parallel contexts;
    what is left holds cached prefixes."""
    per_page = KVCache.page_bytes(layout, dtype, page)
    one_ctx = -(-num_ctx // page)
    if cfg.kv_cache_size and per_page:
        pages = cfg.kv_cache_size // per_page
        if pages < one_ctx:
            need = one_ctx * per_page / 2**20
            raise ValueError(
                f"FREETOKEN_KV_CACHE_SIZE holds {pages * page} tokens, fewer than num_ctx "
                f"{num_ctx} (needs {need:.0f} MiB)"
            )
        return pages
    tokens = max(2 * num_ctx, num_parallel * min(num_ctx, 8192))
    return -(-tokens // page)


def _warm(graphs: DecodeGraphs, kv: KVCache) -> None:
    """Compiles and captures the decode steps' shapes before the first request."""
    t0 = time.perf_counter()
    try:
        steps = graphs.warm(kv.pool)
        log.info("decode graphs: %d shapes warmed in %.1f s", steps, time.perf_counter() - t0)
    except RuntimeError as e:  # a speed-up only: the steps capture when first run
        graphs.reset()
        log.warning("decode graphs: warming failed, shapes capture when first run: %s", e)
