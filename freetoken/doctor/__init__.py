"""`freetoken doctor`: what this machine offers (machine.py), what a model asks (model.py,
fit.py), and the judgement between them (judge.py) that the command prints and a load logs.

The package itself is torch-free (the server estimates a model's needs with fit.py before
it starts a runner); machine.py and judge.py, which ask torch about the GPUs, are imported
where they are used."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from freetoken.doctor.fit import Needs, needs
from freetoken.doctor.model import ModelFacts, from_files, from_source

if TYPE_CHECKING:
    from freetoken.doctor.judge import Verdict

__all__ = ["ModelFacts", "Needs", "at_load", "from_files", "from_source", "needs"]


def at_load(
    name: str, files: dict[str, Path], num_ctx: int, cfg: Any, device: Any = None
) -> Verdict:
    """The judgement `freetoken doctor NAME` prints, for the load of a runner's files onto
    `device` (a torch.device; only its GPU is asked about, so no other gets a context)."""
    from freetoken.doctor.judge import judge
    from freetoken.doctor.machine import probe

    cuda = device is not None and device.type == "cuda"
    devices = [device.index if device.index is not None else 0] if cuda else []
    return judge(probe(cfg, devices=devices), from_files(name, files), num_ctx, cfg)
