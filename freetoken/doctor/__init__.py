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


def at_load(name: str, files: dict[str, Path], num_ctx: int, cfg: Any) -> Verdict:
    """The judgement `freetoken doctor NAME` prints, for the load of a runner's files."""
    return judge(probe(cfg), from_files(name, files), num_ctx, cfg)
