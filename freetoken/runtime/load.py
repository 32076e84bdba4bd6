"""Loading one model for a runner: threads and kernels set up, the other ranks started,
weights read, the KV pool sized, the experts placed, the decode graphs and the engine made.

`ModelLoad.run` does it on the engine thread; `group` is set as soon as other ranks exist,
so a failed load can take them down.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from freetoken import dist
from freetoken.chat import formats
from freetoken.config import parse_size
from freetoken.kernels import cpu as cpu_kernel
from freetoken.layers import fused
from freetoken.moe.backend import ExpertBackend
from freetoken.runtime import loader
from freetoken.runtime.constrain import MaskCache
from freetoken.runtime.engine import Engine
from freetoken.runtime.events import EventFormatter
from freetoken.runtime.graphs import DecodeGraphs
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.prompt import PromptBuilder
from freetoken.runtime.requests import RequestBuilder
from freetoken.runtime.tokenizer import Tokenizer
from freetoken.runtime.vocab import Vocab

log = logging.getLogger("freetoken.runner")


@dataclass
class Serving:
    """What a loaded model is served with."""

    engine: Engine
    experts: ExpertBackend
    requests: RequestBuilder
    formatter: EventFormatter
    load_ns: int
    sizes: dict[str, int] = field(default_factory=dict)  # what /health reports


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
        cpu_kernel.extension()
        # one rank per GPU: the others start now and load their experts while this one loads
        ranks = dist.devices(cfg.gpus, cfg.device)
        device = dist.use(ranks[0]).type
        placement = self.placement()
        if len(ranks) > 1:
            self.group = dist.launch(ranks, self.files, placement, cfg.dtype, on_death=on_death)
        loaded = loader.load(
            self.files,
            device,
            cfg.dtype,
            progress=progress,
            experts=self.group.experts if self.group else None,
            huge_pages=cfg.huge_pages,
        )
        page = cfg.kv_page_size
        pages = (-(-self.num_ctx // page)) * self.num_parallel
        kv = KVCache(loaded.model.kv_layout(), pages, page, loaded.dtype, loaded.device)
        experts = loader.place_experts(loaded, placement, self.group)
        serving = self._serving(loaded, kv, experts)
        serving.load_ns = time.perf_counter_ns() - t0
        log.info("ready: %d KV pages of %d tokens (%.1f MiB)", pages, page, kv.bytes / 2**20)
        return serving

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
        )

    def _serving(self, loaded: loader.Loaded, kv: KVCache, experts: ExpertBackend) -> Serving:
        model, device = loaded.model, loaded.device
        graphs = None
        if device.type == "cuda" and self.cfg.cuda_graphs:
            graphs = DecodeGraphs(model, kv, device, self.num_ctx, max_batch=self.num_parallel)
        tokenizer = Tokenizer(self.files)
        engine = Engine(
            model,
            tokenizer,
            kv,
            device,
            self.num_ctx,
            self.num_parallel,
            self.cfg.prefill_chunk,
            graphs,
        )
        # the vocabulary as bytes, for grammars and logprobs (about a second for 150k tokens)
        vocab = Vocab.from_tokenizer(tokenizer.tok, model.args.vocab_size, formats.MARKERS)
        prompts = PromptBuilder(tokenizer, self.spec.get("template"))
        requests = RequestBuilder(
            tokenizer,
            prompts,
            MaskCache(vocab),
            self.num_ctx,
            architecture=loaded.config.get("model_type"),
        )
        dense = sum(p.numel() * p.element_size() for p in model.parameters())
        on_gpu = device.type == "cuda"
        sizes = {
            "size": dense + experts.host_bytes + kv.bytes,
            "size_vram": (torch.cuda.memory_allocated(device) if on_gpu else 0)
            + experts.vram_elsewhere,
            "kv_cache_bytes": kv.bytes,
            "expert_cache_bytes": experts.capacity * experts.expert_bytes,
        }
        return Serving(engine, experts, requests, EventFormatter(vocab, tokenizer), 0, sizes)
