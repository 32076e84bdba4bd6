"""The server process: residency of loaded models and the runner processes behind them.

`serve()` is what `freetoken serve` runs. Nothing here imports torch; the runners do.
"""

from __future__ import annotations

import logging
from typing import Any

from freetoken import config

__all__ = ["serve"]

log = logging.getLogger("freetoken.server")


def serve(cfg: Any = None) -> None:
    """Prunes the store (unless noprune), then serves the API on `cfg.host` until stopped."""
    import uvicorn

    from freetoken.api import create_app
    from freetoken.store import Store

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
    log.info("models in %s; listening on %s", store.root, cfg.host.url)
    uvicorn.run(
        create_app(cfg, store),
        host=cfg.host.host,
        port=cfg.host.port,
        log_level="debug" if cfg.debug else "info",
        access_log=bool(cfg.debug),
        timeout_graceful_shutdown=5,
    )
