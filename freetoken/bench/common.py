"""What every benchmark prints: the machine, the commit, a table, and JSON lines."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    import torch

    from freetoken.moe.profile import cpu_model

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
    }


def middle(items: list, key: Callable[[Any], float]) -> Any:
    """The item at the median of `key` over `items`: of an even number, the lower of the two
    middle ones. Rates are compared so, on the side that claims less (the upper one made
    `bench serve`'s two windows read 7 % above the independent client's on one server)."""
    ordered = sorted(items, key=key)
    return ordered[(len(ordered) - 1) // 2]


def commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def header(bench: str) -> dict[str, Any]:
    return {
        "bench": bench,
        **machine(),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain-text table; columns are (key, heading); floats show 3 significant digits."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return "" if v is None else str(v)

    grid = [[h for _, h in columns]] + [[cell(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in grid) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in grid]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def emit(
    rows: list[dict[str, Any]], columns: list[tuple[str, str]], as_json: bool, head: dict[str, Any]
) -> None:
    print(
        f"# {head['bench']} | gpu={head['gpu']} | cpu={head['cpu']} | threads={head['threads']} | "
        f"commit={head['commit']} | {head['date']}"
    )
    if head.get("settings"):  # what the measured server ran with, beside its defaults
        print("# settings: " + " ".join(f"{k}={v}" for k, v in sorted(head["settings"].items())))
    print(table(rows, columns))
    if as_json:
        for r in rows:
            print(json.dumps({**head, **r}))
