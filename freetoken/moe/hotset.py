"""Which experts a model's GPU cache held when it last went idle, kept across loads.

A load fills the expert cache before the first request. Filled at random, the first answer
meets a cold cache and fetches its working set one miss at a time: on the H200 (12-layer
Qwen3-30B-A3B shape, 75 % of the experts cached) the first 512-token answer after a load ran
at 4.5 ms a step against 1.65 ms once its experts were in. Ollama unloads an idle model after
five minutes, so users meet that first answer often. What the cache held when serving last
went idle is kept in the cache directory, keyed by the model's weights and this machine, and
the next load fills those slots first.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from freetoken.moe import profile
from freetoken.moe.cache import ExpertCache

__all__ = ["HotSet", "resident"]

SAVE_EVERY_S = 30.0  # the least time between two saves (each pulls the books to the host)


def resident(cache: ExpertCache, layers: list[int]) -> dict[int, list[int]]:
    """Each layer's experts in the cache, the most recently used first."""
    out = {}
    for layer in layers:
        slots = cache.slot_of[layer]
        have = np.flatnonzero(slots >= 0)
        if len(have):
            recent = np.argsort(-cache.last_use[slots[have]], kind="stable")
            out[layer] = have[recent].tolist()
    return out


class HotSet:
    def __init__(self, cache_dir: Path, model_key: str):
        self.cache_dir, self.model_key = Path(cache_dir), model_key

    @property
    def path(self) -> Path:
        key = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.model_key)
        return self.cache_dir / "hot" / profile.machine_key() / f"{key}.json"

    def load(self) -> dict[int, list[int]]:
        """Each layer's experts, as saved; {} where nothing (readable) was."""
        try:
            data = json.loads(self.path.read_text())
            return {int(layer): [int(e) for e in experts] for layer, experts in data.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def save(self, experts: dict[int, list[int]]) -> None:
        p = self.path
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(".tmp")
            tmp.write_text(json.dumps({str(k): v for k, v in sorted(experts.items())}))
            tmp.replace(p)
        except OSError:  # a read-only cache directory costs the next load its warm start
            pass
