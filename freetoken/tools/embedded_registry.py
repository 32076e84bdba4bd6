"""Builds the registry directory shipped in the repository (freetoken/registry/embedded).

    python -m freetoken.tools.embedded_registry freetoken/registry/embedded [--weights DIR]

It holds the demo model (`demo:latest`), pushed with the real push path into a registry
root, so the Quick start pulls it offline with the real pull path.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import uvicorn

from freetoken.store import CreateSpec, Store
from freetoken.tools import demo

PORT_HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((PORT_HOST, 0))
        return s.getsockname()[1]


def build(root: Path, trained: Path | None = None) -> None:
    """The registry at `root`, anew, holding the demo (`trained`'s weights where given: a
    freetoken.tools.train_demo output)."""
    from freetoken.registry import create_app

    if root.exists():
        shutil.rmtree(root)
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(root), host=PORT_HOST, port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            modelfile = demo.write_demo(Path(tmp) / "demo", trained=trained)
            store = Store(Path(tmp) / "store")
            name = f"{PORT_HOST}:{port}/library/demo:latest"
            spec = CreateSpec(
                name=name,
                from_=str(modelfile.parent / "weights"),
                system=demo.SYSTEM,
                parameters=demo.PARAMETERS,
            )
            for _ in store.plan_create(spec).run():
                pass
            from freetoken.pull import push_model

            push_model(store, name, insecure=True)
    finally:
        server.should_exit = True
        thread.join(10)
    for leftover in (root / "uploads").glob("*"):
        leftover.unlink()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--weights", type=Path, help="the trained demo's directory (train_demo)")
    args = ap.parse_args()
    build(args.root, args.weights)


if __name__ == "__main__":
    main()
