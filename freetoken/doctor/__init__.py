"""`freetoken doctor`: what this machine offers (machine.py), what a model asks (model.py),
and the judgement between them (judge.py) that the command prints and a load logs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from freetoken.doctor.judge import Verdict, judge
from freetoken.doctor.machine import Machine, probe
from freetoken.doctor.model import ModelFacts, from_files, from_source

__all__ = [
    "Machine",
    "ModelFacts",
    "Verdict",
    "at_load",
    "from_files",
    "from_source",
    "judge",
    "probe",
]


def at_load(
    name: str, files: dict[str, Path], num_ctx: int, cfg: Any, device: Any = None
) -> Verdict:
    """The judgement `freetoken doctor NAME` prints, for the load of a runner's files onto
    `device` (a torch.device; only its GPU is asked about, so no other gets a context)."""
    cuda = device is not None and device.type == "cuda"
    devices = [device.index if device.index is not None else 0] if cuda else []
    return judge(probe(cfg, devices=devices), from_files(name, files), num_ctx, cfg)
