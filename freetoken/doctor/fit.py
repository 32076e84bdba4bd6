"""What a model needs of a machine to load: host memory for its expert banks (every weight,
on a CPU) and GPU memory for its dense weights, its KV cache and the smallest expert cache
(one layer's experts). The one estimate behind `freetoken doctor`, the judgement a load logs
and the server's check before it starts a runner; torch-free, so the server can use it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.doctor.model import ModelFacts
from freetoken.moe.budget import ACTIVATION_RESERVE

__all__ = ["HOST_SHARE", "VRAM_SHARE", "Needs", "gib", "kv_bytes", "needs"]

HOST_SHARE = 0.95  # of available host memory a load may count on
VRAM_SHARE = 0.92  # of free GPU memory: the allocator's slack and other programs


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


@dataclass(frozen=True)
class Needs:
    """Bytes a load takes at least. On a GPU: `host` the banks, `vram` the dense weights,
    KV cache, workspace and one layer's experts. On a CPU: `host` everything, `vram` 0."""

    host: int
    vram: int
    dense: int
    kv: int
    cache: int  # the smallest expert cache: one layer's experts (0 on a CPU)
    on_gpu: bool

    def host_text(self) -> str:
        what = "its expert banks" if self.on_gpu else "its weights and KV cache"
        return f"{gib(self.host)} of host memory for {what}"

    def vram_text(self) -> str:
        return (
            f"{gib(self.vram)} of GPU memory ({gib(self.dense)} dense weights, {gib(self.kv)} "
            f"KV cache, {gib(self.cache)} for one layer's experts, "
            f"{gib(ACTIVATION_RESERVE)} workspace)"
        )


def kv_bytes(model: ModelFacts, num_ctx: int, num_parallel: int, kv_cache_size: int) -> int:
    """The KV pool a load allocates (the runtime's default size, or the setting's)."""
    if kv_cache_size:
        return int(kv_cache_size)
    return model.kv_bytes_per_token * max(2 * num_ctx, num_parallel * min(num_ctx, 8192))


def needs(model: ModelFacts, num_ctx: int, cfg: Any, on_gpu: bool, num_parallel: int = 0) -> Needs:
    """What loading `model` with a `num_ctx` window takes under settings `cfg`."""
    kv = kv_bytes(model, num_ctx, num_parallel or cfg.num_parallel, cfg.kv_cache_size)
    if not on_gpu:
        return Needs(model.total_bytes + kv, 0, model.dense_bytes, kv, 0, False)
    cache = model.experts * model.expert_bytes
    vram = model.dense_bytes + kv + ACTIVATION_RESERVE + cache
    return Needs(model.bank_bytes, vram, model.dense_bytes, kv, cache, True)
