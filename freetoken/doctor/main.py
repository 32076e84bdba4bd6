"""`freetoken doctor [MODEL] [--build] [--json]`: what this machine can serve, and how.

MODEL is a model in the store, a Hugging Face directory or a GGUF file. Runs without a
server; exits 1 when the model does not fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

import freetoken
from freetoken import config
from freetoken.doctor import machine as machines
from freetoken.doctor import model as models
from freetoken.doctor.judge import judge

__all__ = ["main", "model_facts"]


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def machine_lines(m: machines.Machine) -> list[tuple[str, str]]:
    gpus = "; ".join(f"{g.index}: {g.name}, {_gib(g.free)} free of {_gib(g.total)}" for g in m.gpus)
    memlock = "unlimited" if m.memlock is None else f"{m.memlock / 2**20:.0f} MiB"
    how = (
        "measured by `freetoken bench bw`"
        if m.by_bench
        else "timed by a model's first load: run `freetoken bench bw`"
        if m.measured
        else "defaults: run `freetoken bench bw`"
    )
    return [
        ("torch", m.torch_build),
        ("GPU", gpus or "none: models run on the CPU"),
        ("CPU", f"{m.cores} cores; experts on the CPU: {m.kernel.kernel} ({m.kernel.reason})"),
        ("RAM", f"{_gib(m.ram_total)} total, {_gib(m.ram_available)} available"),
        ("pinning", f"{m.pinning}; memlock limit {memlock}"),
        ("disk", f"{_gib(m.disk_free)} free for the store in {m.store}"),
        ("bandwidth", f"B_P {m.b_p / 1e9:.1f} GB/s, B_H {m.b_h / 1e9:.1f} GB/s ({how})"),
    ]


def model_facts(name: str, cfg: Any) -> tuple[models.ModelFacts, int]:
    """(facts, the num_ctx a load would use) for a path or a model in the store."""
    from freetoken.server.residency import default_num_ctx
    from freetoken.store import Store

    path = Path(name).expanduser()
    if path.exists():
        facts = models.from_source(path)
        return facts, default_num_ctx(None, facts.context_length, cfg.context_length)
    store = Store(cfg.models)
    view = store.resolve(name)
    files = {k: Path(v) for k, v in store.runner_files(view).items()}
    facts = models.from_files(view.display, files)
    requested = view.params.get("num_ctx")
    n = default_num_ctx(requested, facts.context_length or None, cfg.context_length)
    return facts, n


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="freetoken doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="a model in the store, a HF directory or a .gguf")
    p.add_argument(
        "--build", action="store_true", help="build the CPU expert kernel now (install does)"
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    # the kernel build's progress line goes to the terminal
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    cfg = config.current()
    m = machines.probe(cfg, build=args.build)
    out: dict[str, Any] = {"version": freetoken.__version__, "machine": dataclasses.asdict(m)}
    verdict = None
    if args.model:
        from freetoken.store import ModelNotFound

        try:
            facts, num_ctx = model_facts(args.model, cfg)
        except (ModelNotFound, OSError, ValueError, KeyError) as e:
            raise SystemExit(f"Error: {args.model}: {e}") from None
        verdict = judge(m, facts, num_ctx, cfg)
        out["model"] = {**dataclasses.asdict(facts), "num_ctx": num_ctx}
        out["verdict"] = dataclasses.asdict(verdict)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        _print(m, args.model, out, verdict)
    if verdict is not None and not verdict.fits:
        raise SystemExit(1)


def _print(m: machines.Machine, name: str | None, out: dict, verdict) -> None:
    print(f"FreeToken {freetoken.__version__}")
    for key, value in machine_lines(m):
        print(f"  {key:<10} {value}")
    if verdict is None:
        if not m.kernel.compiled:
            print("\nRun `freetoken doctor --build` to build the CPU expert kernel now.")
        print("\n`freetoken doctor MODEL` says whether a model fits and how it would run.")
        return
    facts = out["model"]
    print(
        f"\n{facts['name']}: {_gib(facts['bank_bytes'])} of experts "
        f"({facts['moe_layers']} layers x {facts['experts']}, {facts['experts_per_token']} a "
        f"token), {_gib(facts['dense_bytes'])} dense, num_ctx {facts['num_ctx']}"
    )
    print(f"  {'fits' if verdict.fits else 'DOES NOT FIT'}")
    for line in verdict.lines():
        print(f"  {line}")


if __name__ == "__main__":
    main()
