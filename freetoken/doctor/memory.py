"""What memory this machine has free for a model, read without torch: host memory from
/proc/meminfo, a GPU's from `nvidia-smi` (the server, which never imports torch, asks before
it starts a runner). `MemoryProbe` is the contract; tests stand their own figures in."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from freetoken import config

__all__ = ["Free", "MemoryProbe", "SystemMemory", "meminfo", "runner_gpu"]

_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Free:
    """Bytes free now: `host` (MemAvailable), and `vram` on the GPU a runner would use, or
    None where the GPU's memory cannot be read. `gpu`: the runner will use a GPU."""

    host: int
    gpu: bool
    vram: int | None = None


class MemoryProbe(Protocol):
    def free(self) -> Free:
        """Measures now (called from a worker thread: it may block briefly)."""
        ...


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, ...); empty where there is none."""
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def runner_gpu(cfg: Any) -> int | None:
    """The GPU (as torch numbers them) a runner puts dense weights on: the first of
    FREETOKEN_GPUS; None for a CPU runner."""
    if cfg.device == "cpu" or (isinstance(cfg.gpus, str) and cfg.gpus.startswith("cpu:")):
        return None
    return cfg.gpus[0] if isinstance(cfg.gpus, tuple) and cfg.gpus else 0


def _smi_rows() -> list[tuple[str, str, int]] | None:
    """(index, uuid, free bytes) of each GPU nvidia-smi lists; None where it cannot."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    cmd = [smi, "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    rows = []
    for line in out.stdout.strip().splitlines():
        index, uuid, free = (x.strip() for x in line.split(","))
        rows.append((index, uuid, int(free) << 20))  # MiB
    return rows


def _physical(logical: int, rows: list[tuple[str, str, int]]) -> int | None:
    """The free bytes of torch's GPU `logical`: CUDA_VISIBLE_DEVICES renumbers the GPUs
    nvidia-smi lists by index or UUID."""
    mask = config.cuda_visible_devices()
    names = [x.strip() for x in mask.split(",")] if mask is not None else [r[0] for r in rows]
    if logical >= len(names):
        return None
    name = names[logical]
    for index, uuid, free in rows:
        if name == index or (name.startswith("GPU-") and uuid.startswith(name)):
            return free
    return None


class SystemMemory:
    """This machine's figures: MemAvailable and nvidia-smi's free memory of the runner's GPU.
    Without nvidia-smi a runner that would find a GPU (FREETOKEN_DEVICE=cuda) is judged on
    host memory only; with device `auto`, as running on the CPU."""

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def free(self) -> Free:
        mem = meminfo()
        host = mem.get("MemAvailable", mem.get("MemFree", 0))
        gpu = runner_gpu(self.cfg)
        rows = _smi_rows() if gpu is not None else None
        if gpu is None or (rows is None and self.cfg.device != "cuda"):
            return Free(host, gpu=False)
        return Free(host, gpu=True, vram=_physical(gpu, rows) if rows else None)
