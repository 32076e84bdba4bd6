"""`freetoken cache`: the GPU expert cache of loaded models, and resizing it live.

freetoken cache                         one line per loaded model
freetoken cache resize [MODEL] SIZE     SIZE like 12GiB, or --slots N
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from freetoken.cli.client import Client
from freetoken.cli.display import human_size, table
from freetoken.cli.errors import CommandError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cache", help="show or resize the GPU expert cache of loaded models")
    p.add_argument("action", nargs="?", choices=["resize"], help="resize a model's expert cache")
    p.add_argument(
        "targets", nargs="*", metavar="[MODEL] SIZE", help="model (if several are loaded) and size"
    )
    p.add_argument("--slots", type=int, help="the new size as a number of expert slots")


def _pct(x: Any) -> str:
    return "" if x is None else f"{100 * float(x):.0f}%"


def _ms(x: Any) -> str:
    return "" if x is None else f"{float(x):.2f}"


def _policy(m: dict[str, Any]) -> str:
    """The policy, and for adaptive the placement it measured fastest, with the stream counts
    served in a placement of their own (a size where a switch was found slower)."""
    policy = str(m.get("policy") or "")
    if not m.get("placement"):
        return policy
    own = sorted((m.get("placement_by_batch") or {}).items(), key=lambda i: int(i[0]))
    sizes = "".join(f"; {b} {'stream' if int(b) == 1 else 'streams'}: {p}" for b, p in own)
    return f"{policy} ({m['placement']}{sizes})"


def _rows(models: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    rows = []
    for m in models:
        c = m.get("cache") or {}
        recent = m.get("recent") or {}
        rows.append(
            (
                m["name"],
                _policy(m),
                str(c.get("slots", "")),
                human_size(c.get("bytes") or 0) if c else "",
                str(c.get("used", "")),
                _pct(c.get("hit_rate")) if c else "",
                _pct(recent.get("hit_rate")),
                "" if not recent else f"{recent['misses_per_token']:.1f}",
                _pct(m.get("fetched_share")),
                _ms(m.get("pcie_ms_per_expert")),
                _ms(m.get("cpu_ms_per_expert")),
            )
        )
    return rows


def cmd_cache(args: argparse.Namespace, client: Client) -> int:
    models = (client.call("GET", "/api/cache") or {}).get("models") or []
    if args.action != "resize":
        head = (
            "NAME",
            "POLICY",
            "SLOTS",
            "SIZE",
            "USED",
            "HIT",
            "RECENT HIT",
            "MISSES/TOKEN",
            "FETCHED",
            "PCIE MS/EXPERT",
            "CPU MS/EXPERT",
        )
        sys.stdout.write(table(head, _rows(models)) + "\n")
        return 0
    targets = list(args.targets)
    if args.slots is None and not targets:
        raise CommandError("give a size (e.g. 12GiB) or --slots N")
    size = None if args.slots is not None else targets.pop()
    if targets:
        model = targets[0]
    elif len(models) == 1:
        model = models[0]["name"]
    else:
        raise CommandError(
            "name the model: " + (", ".join(m["name"] for m in models) or "none is loaded")
        )
    body: dict[str, Any] = {"model": model}
    body.update({"slots": args.slots} if args.slots is not None else {"size": size})
    r = client.call("POST", "/api/cache/resize", body) or {}
    sys.stdout.write(
        f"{model}: {r.get('slots')} expert slots ({human_size(r.get('bytes') or 0)}), "
        f"{r.get('kept')} experts kept\n"
    )
    return 0
