"""What adaptive learned about a model's placement on this machine, kept across loads.

A model served again — after keep_alive unloaded it, or the server restarted — on the same
machine with the same cache size meets the same bandwidths: its first answer starts in the
placement measured fastest last time (each batch size that served faster in a mode of its
own in that one), with the share of misses it had tuned, and the next measurement waits a
full period. Kept beside the bandwidth profile in the cache directory, keyed by the
machine, the experts' shape, the settings of the CPU lane (moe/setup.py) and the cache's
size.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from freetoken.moe import profile

__all__ = ["Learned", "forget"]


def forget(cache_dir: Path) -> bool:
    """Drops what adaptive learned on this machine, for every model and setting: the next
    load starts from the bandwidths' prediction, as a first load does. True where there was
    something to drop."""
    kept = Path(cache_dir) / "placement" / profile.machine_key()
    if not kept.is_dir():
        return False
    shutil.rmtree(kept, ignore_errors=True)
    return True


class Learned:
    def __init__(self, cache_dir: Path, shape: str):
        self.cache_dir, self.shape = Path(cache_dir), shape

    def path(self, capacity: int) -> Path:
        key = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{self.shape}--{capacity}")
        return self.cache_dir / "placement" / profile.machine_key() / f"{key}.json"

    def load(self, capacity: int) -> dict[str, Any] | None:
        try:
            data = json.loads(self.path(capacity).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("mode"), str):
            return None
        # a placement measured before modes were compared at one batch size may have been
        # chosen for a batch it never served: measured again instead
        if not isinstance(data.get("batch"), int):
            return None
        out = data.get("sitting_out")
        if not isinstance(out, dict) or not all(
            isinstance(m, str) and isinstance(n, int) and n > 0 for m, n in out.items()
        ):  # kept by an older version, or damaged: every mode takes part
            data["sitting_out"] = {}
        data["by_batch"] = _by_batch(data.get("by_batch"))
        return data

    def save(self, capacity: int, data: dict[str, Any]) -> None:
        p = self.path(capacity)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=2))
            tmp.replace(p)
        except OSError:  # a read-only cache directory costs the next load its head start
            pass


def _by_batch(kept: Any) -> dict[int, str]:
    """The batch sizes a load before served in a mode of their own (JSON keys are strings);
    none where an older version kept none, or the entry is damaged."""
    if not isinstance(kept, dict):
        return {}
    try:
        out = {int(b): m for b, m in kept.items()}
    except ValueError:
        return {}
    return out if all(b > 0 and isinstance(m, str) for b, m in out.items()) else {}
