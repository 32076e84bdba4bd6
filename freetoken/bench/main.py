"""`freetoken bench <name>`: dispatches to one benchmark module."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "bw": "freetoken.bench.bw",
    "load": "freetoken.bench.load",
    "decode": "freetoken.bench.decode",
    "prefill": "freetoken.bench.prefill",
    "resize": "freetoken.bench.resize",
    "pull": "freetoken.bench.pull",
    "gpus": "freetoken.bench.gpus",
    "agent": "freetoken.bench.agent",
    "serve": "freetoken.bench.serve",
    "grammar": "freetoken.bench.grammar",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHES:
        print(
            f"usage: freetoken bench {{{','.join(BENCHES)}}} [options]  (each takes --help)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    importlib.import_module(BENCHES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
