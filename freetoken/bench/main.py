"""`freetoken bench <name>`: dispatches to one benchmark module."""

from __future__ import annotations

import importlib
import sys

# name -> (module, what it measures): the line `freetoken bench --help` shows. Each module's
# own --help says the rest; importing them all for their docstrings would import torch.
BENCHES = {
    "bw": ("freetoken.bench.bw", "host-to-GPU (B_P) and CPU expert (B_H) bandwidths; cached"),
    "load": ("freetoken.bench.load", "FTW load speed against a raw direct read of the files"),
    "decode": (
        "freetoken.bench.decode",
        "one sequence's decode tok/s per policy, against the bound",
    ),
    "prefill": ("freetoken.bench.prefill", "prompt throughput with whole-layer expert streaming"),
    "resize": ("freetoken.bench.resize", "shrinking and growing the expert cache while decoding"),
    "pull": ("freetoken.bench.pull", "pull throughput on loopback, and resuming a cut pull"),
    "create": ("freetoken.bench.create", "create of a checkpoint against reading and writing it"),
    "gpus": ("freetoken.bench.gpus", "decode and prefill with the experts over several GPUs"),
    "agent": ("freetoken.bench.agent", "a coding agent's session through a running server"),
    "serve": ("freetoken.bench.serve", "decode as users meet it, through the HTTP server"),
    "soak": ("freetoken.bench.soak", "load, faults and fuzz through a server of its own"),
    "draw": ("freetoken.bench.draw", "drawing a token on the GPU: µs a draw, kernels and torch"),
    "grammar": (
        "freetoken.bench.grammar",
        "constrained decoding: mask µs per token, decode tok/s against free",
    ),
}


def usage() -> str:
    width = max(map(len, BENCHES))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in BENCHES.items())
    return (
        "usage: freetoken bench NAME [options]\n\n"
        "Measures this machine or a model on it (results: docs/benchmarks.md).\n\n"
        f"benchmarks:\n{rows}\n\n"
        "`freetoken bench NAME --help` lists a benchmark's options.\n"
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        sys.stdout.write(usage())
        return
    if not argv or argv[0] not in BENCHES:
        sys.stderr.write(usage())
        raise SystemExit(2)
    importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    main()
