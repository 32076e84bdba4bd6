"""`python -m freetoken.registry serve --root DIR [--host H] [--port P] [--token T]
[--challenge [--keys FILE]]`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from freetoken.registry.auth import ChallengeAuth

__all__ = ["main", "serve"]

log = logging.getLogger(__name__)


def serve(
    root: Path,
    host: str = "127.0.0.1",
    port: int = 11435,
    token: str | None = None,
    challenge: ChallengeAuth | None = None,
) -> None:
    """Serves the registry in `root` until the process is told to stop."""
    import uvicorn

    from freetoken.registry.app import create_app

    app = create_app(root, token, challenge)
    log.info(
        "registry in %s on http://%s:%d (writes %s)",
        root,
        host,
        port,
        "need the token" if token else "are open",
    )
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m freetoken.registry", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("serve", help="serve a registry directory over HTTP")
    cmd.add_argument(
        "--root", type=Path, required=True, help="directory holding blobs and manifests"
    )
    cmd.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    cmd.add_argument("--port", type=int, default=11435, help="port to listen on (default 11435)")
    cmd.add_argument(
        "--token", default=None, help="Bearer token that writes must carry (reads stay open)"
    )
    cmd.add_argument(
        "--challenge",
        action="store_true",
        help="ask for tokens as Ollama's registry does (signed with the client's ed25519 key)",
    )
    cmd.add_argument(
        "--keys",
        type=Path,
        default=None,
        help="with --challenge: public keys (id_ed25519.pub lines) allowed to push; "
        "without it any key that signs may",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    challenge = ChallengeAuth.from_keys_file(args.keys) if args.challenge else None
    serve(args.root, args.host, args.port, args.token, challenge)


if __name__ == "__main__":
    main()
