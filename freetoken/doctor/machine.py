"""What this machine offers a model: GPUs and their memory, host RAM, whether host memory
can be pinned, disk for the store, the CPU kernel, and the bandwidths `bench bw` measured."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from freetoken.doctor.memory import meminfo
from freetoken.ftw import hostmem
from freetoken.kernels import cpu as cpu_kernel
from freetoken.moe import profile

__all__ = ["Gpu", "Machine", "meminfo", "probe"]


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total: int  # bytes
    free: int


@dataclass
class Machine:
    torch_build: str  # "2.13.0 (CUDA 12.8)", "2.13.0+cpu (CPU-only build)"
    gpus: list[Gpu]
    cores: int
    ram_total: int
    ram_available: int
    memlock: int | None  # RLIMIT_MEMLOCK in bytes; None: unlimited
    pinning: str  # "ok", "refused: …", or "not needed without a GPU"
    store: Path
    disk_free: int
    kernel: cpu_kernel.Status
    b_p: float  # bytes/s, host -> GPU experts
    b_h: float  # bytes/s, the CPU expert kernel
    measured: bool  # B_P and B_H were measured on this machine (bench bw, or a load's probe)
    by_bench: bool = False  # by `freetoken bench bw`, not only a load's 0.2 s probe
    notes: list[str] = field(default_factory=list)

    @property
    def vram_free(self) -> int:
        return self.gpus[0].free if self.gpus else 0

    @property
    def pinned(self) -> bool:
        return self.pinning == "ok"


def _gpus(devices: list[int] | None) -> list[Gpu]:
    """Each GPU asked about (None: every visible one): asking makes a CUDA context there."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()) if devices is None else devices:
        free, total = torch.cuda.mem_get_info(i)
        out.append(Gpu(i, torch.cuda.get_device_name(i), total, free))
    return out


def _pinning(gpus: list[Gpu]) -> str:
    """Registers a small buffer as a load would: a memlock limit or a pin quota says no here."""
    if not gpus:
        return "not needed without a GPU"
    if hostmem.refused() is not None:
        return f"refused: {hostmem.refused()}"
    buf = hostmem.HostBuffer(2 << 20)
    try:
        buf.pin()
    except hostmem.PinRefused as e:
        return f"refused: {e}"
    return "ok"


def _disk_free(path: Path) -> int:
    while not path.exists() and path != path.parent:
        path = path.parent  # the store may not exist yet: its filesystem does
    return shutil.disk_usage(path).free


def torch_build() -> str:
    if torch.version.cuda:
        return f"{torch.__version__} (CUDA {torch.version.cuda})"
    return f"{torch.__version__} (CPU-only build)"


def probe(cfg: Any, build: bool = False, devices: list[int] | None = None) -> Machine:
    """The machine as a load would find it; `build` builds the CPU kernel if need be;
    `devices` the GPUs to report (None: every visible one)."""
    gpus = _gpus(devices)
    mem = meminfo()
    b_p, b_h, measured = profile.bandwidths(cfg.cache_dir)
    return Machine(
        torch_build=torch_build(),
        gpus=gpus,
        cores=len(cpu_kernel.physical_cpus()) or os.cpu_count() or 1,
        ram_total=mem.get("MemTotal", 0),
        ram_available=mem.get("MemAvailable", mem.get("MemFree", 0)),
        memlock=hostmem.memlock_limit(),
        pinning=_pinning(gpus),
        store=Path(cfg.models),
        disk_free=_disk_free(Path(cfg.models)),
        kernel=cpu_kernel.status() if build else cpu_kernel.peek(),
        b_p=b_p,
        b_h=b_h,
        measured=measured,
        by_bench=profile.from_bench(cfg.cache_dir),
    )
