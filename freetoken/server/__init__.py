"""The server process: residency of loaded models and the runner processes behind them.

`serve()` is what `freetoken serve` runs. Nothing here imports torch; the runners do.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from freetoken import config

__all__ = ["BindError", "bind", "serve"]

log = logging.getLogger("freetoken.server")


def serve(cfg: Any = None) -> None:
    """Prunes the store (unless noprune), then serves the API on `cfg.host` until stopped."""
    import uvicorn

    from freetoken.api import create_app
    from freetoken.store import Store, convert

    cfg = cfg or config.current()
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.DEBUG if cfg.debug else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    if not cfg.debug:
        # httpx logs each request at INFO, and a loading runner is polled many times a second.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    store = Store(cfg.models)
    store.blobs.ensure()
    store.manifests.mkdir(parents=True, exist_ok=True)
    if not cfg.noprune:
        removed = store.prune()
        if removed:
            log.info("pruned %d unused or partial files from %s", len(removed), store.root)
    # Bound before anything says "listening": a second server on a busy port stops here,
    # with Ollama's words, instead of logging an address it never gets.
    sock = bind(cfg.host.host, cfg.host.port)
    log.info("models in %s; listening on %s", store.root, cfg.host.url)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(cfg, store, spare=cfg.warm_start),
            log_level="debug" if cfg.debug else "info",
            access_log=bool(cfg.debug),
            timeout_graceful_shutdown=5,
        )
    )
    if cfg.warm_start:  # a converter started ahead (the app starts a runner ahead)
        convert.SPARE.start(convert.interpreter())
    # (uvicorn ends a SIGTERM'd process by raising the signal again: then the spares end
    # on their own, at the end of their input)
    try:
        server.run(sockets=[sock])
    finally:
        convert.SPARE.close()


class BindError(RuntimeError):
    """The address cannot be listened on: another server has it, or it is not this host's."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or BindError naming the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise BindError(f"listen tcp {where}: bind: {(e.strerror or str(e)).lower()}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
