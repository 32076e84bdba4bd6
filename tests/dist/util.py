"""A distributed engine in the test process: rank 0 here, followers as real child processes."""

from __future__ import annotations

from pathlib import Path

from freetoken import dist
from freetoken.runtime import loader
from freetoken.runtime.engine import Engine
from freetoken.runtime.graphs import DecodeGraphs
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.tokenizer import Tokenizer
from tests.runtime.engine_util import files_of


def dist_engine(
    path: Path,
    world: int,
    *,
    policy: str = "adaptive",
    slots: int = 0,
    page_size: int = 16,
    pages: int = 64,
    chunk: int = 2048,
    gpus: bool = False,
    graphs: bool = False,
) -> Engine:
    """An engine whose experts are spread over `world` ranks: CPU ranks on gloo, or with
    gpus=True one per GPU on NCCL (graphs: decode steps replayed from CUDA graphs). Close it
    with `backend(engine).close()`."""
    files = files_of(path)
    placement = loader.Placement(policy, 0, None, slots)
    devices = [f"cuda:{i}" for i in range(world)] if gpus else ["cpu"] * world
    device = dist.use(devices[0]).type
    group = dist.launch(devices, files, placement)
    try:
        loaded = loader.load(files, device, "auto", experts=group.experts)
        loader.place_experts(loaded, placement, group)
    except BaseException:
        group.abort("the test's setup failed")
        raise
    kv = KVCache(loaded.model.kv_layout(), pages, page_size, loaded.dtype, loaded.device)
    dg = DecodeGraphs(loaded.model, kv, loaded.device, 512, max_batch=4) if graphs else None
    return Engine(loaded.model, Tokenizer(files), kv, loaded.device, 512, 4, chunk, dg)


def backend(engine: Engine):
    return engine.model.model.layers[0].mlp.experts.backend


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
