"""Measured bandwidths of this machine: B_P (host->GPU expert gather) and B_H (CPU expert kernel).

`freetoken bench bw` measures them and stores one profile per CPU and GPU in the cache
directory (a model's first load on a machine without one times its own banks briefly and
stores that: moe/probe.py); the runner starts its split from the stored profile and
corrects it online.
"""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path
from typing import Any

# Used until `freetoken bench bw` has run: modest values that online timing quickly replaces.
DEFAULT_PCIE_GBPS = 20.0
DEFAULT_CPU_GBPS = 20.0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def machine_key() -> str:
    import torch

    cpu = cpu_model()
    gpu = "nogpu"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name}-{getattr(props, 'uuid', '')}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{cpu}--{gpu}")[:200]


def path(cache_dir: Path) -> Path:
    return Path(cache_dir) / "bw" / f"{machine_key()}.json"


def load(cache_dir: Path) -> dict[str, Any] | None:
    p = path(cache_dir)
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def save(cache_dir: Path, profile: dict[str, Any]) -> Path:
    p = path(cache_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(p)
    return p


def bandwidths(cache_dir: Path, fmt: str = "") -> tuple[float, float, bool]:
    """(B_P, B_H) in bytes/s and whether they were measured on this machine. B_H is the CPU
    kernel's on banks of block format `fmt` where `bench bw` measured it (decoding costs
    differ by format), else BF16's."""
    prof = load(cache_dir) or {}
    cpu = (prof.get(f"cpu_expert_gbps_{fmt}") if fmt else None) or prof.get("cpu_expert_gbps")
    if cpu:
        return float(prof.get("pcie_gbps") or DEFAULT_PCIE_GBPS) * 1e9, float(cpu) * 1e9, True
    return DEFAULT_PCIE_GBPS * 1e9, DEFAULT_CPU_GBPS * 1e9, False


def fetch_gbps(cache_dir: Path) -> float | None:
    """GB/s of the fetch kernel that device-kept books copy a miss with, one expert a call,
    where `bench bw` measured it: what a miss costs the placements that fetch on the device.
    A GPU's own reads of host memory need not reach the copy engine's B_P (0.63 of it on one
    H100 machine, 0.99 on another)."""
    fetch = ((load(cache_dir) or {}).get("fetch") or {}).get("1") or {}
    gbps = fetch.get("gbps")
    return float(gbps) if gbps else None


def from_bench(cache_dir: Path) -> bool:
    """Whether this machine's profile was measured by `freetoken bench bw`, not only timed
    for a fraction of a second at a model's first load (moe/probe.py marks those): on a
    fresh H100 machine such a probe gave B_P 29.8 and B_H 44.2 GB/s where bench bw measures
    50.2 and 81.8 (Q4_K)."""
    prof = load(cache_dir)
    return prof is not None and prof.get("source") != "load"
