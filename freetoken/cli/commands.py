"""The short verbs: list, ps, show, cp, rm, stop, pull, push, create, version and serve.

Each takes the parsed arguments and a Client, writes to stdout (results) or stderr
(progress, warnings), and returns the exit status; errors are raised for `main` to print.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import freetoken
from freetoken.cli import show as showmod
from freetoken.cli.client import Client
from freetoken.cli.display import (
    human_size,
    parse_time,
    processor,
    relative_time,
    table,
    until,
)
from freetoken.cli.errors import CommandError, NotRunning, ServerError
from freetoken.cli.progress import Progress

__all__ = [
    "cmd_cp",
    "cmd_create",
    "cmd_list",
    "cmd_ps",
    "cmd_pull",
    "cmd_push",
    "cmd_rm",
    "cmd_serve",
    "cmd_show",
    "cmd_stop",
    "cmd_version",
    "transfer",
]

SHOW_FIELDS = ("license", "modelfile", "parameters", "template", "system")


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_list(args: argparse.Namespace, client: Client) -> int:
    models = (client.call("GET", "/api/tags") or {}).get("models") or []
    rows = []
    for m in models:
        modified = parse_time(m.get("modified_at"))
        rows.append(
            (
                m.get("name") or m.get("model", ""),
                (m.get("digest") or "")[:12],
                human_size(m.get("size") or 0),
                relative_time(modified) if modified else "",
            )
        )
    _out(table(("NAME", "ID", "SIZE", "MODIFIED"), rows))
    return 0


def cmd_ps(args: argparse.Namespace, client: Client) -> int:
    models = (client.call("GET", "/api/ps") or {}).get("models") or []
    rows = []
    for m in models:
        size, vram = int(m.get("size") or 0), int(m.get("size_vram") or 0)
        rows.append(
            (
                m.get("name") or m.get("model", ""),
                (m.get("digest") or "")[:12],
                human_size(size),
                processor(size, vram),
                str(m.get("context_length") or ""),
                until(m.get("expires_at")),
            )
        )
    _out(table(("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"), rows))
    return 0


def cmd_show(args: argparse.Namespace, client: Client) -> int:
    wanted = [f for f in SHOW_FIELDS if getattr(args, f)]
    if len(wanted) > 1:
        raise CommandError(
            "only one of " + ", ".join(f"'--{f}'" for f in SHOW_FIELDS) + " can be given"
        )
    body: dict[str, Any] = {"model": args.model}
    if args.verbose:
        body["verbose"] = True
    resp = client.call("POST", "/api/show", body) or {}
    _out(showmod.field_text(resp, wanted[0]) if wanted else showmod.render(resp, args.verbose))
    return 0


def cmd_cp(args: argparse.Namespace, client: Client) -> int:
    client.call("POST", "/api/copy", {"source": args.source, "destination": args.destination})
    _out(f"copied '{args.source}' to '{args.destination}'\n")
    return 0


def _loaded(client: Client) -> set[str]:
    models = (client.call("GET", "/api/ps") or {}).get("models") or []
    return {m.get("name") or m.get("model", "") for m in models}


def _unload(client: Client, model: str) -> None:
    for _ in client.stream("/api/generate", {"model": model, "keep_alive": 0}):
        pass


def cmd_rm(args: argparse.Namespace, client: Client) -> int:
    loaded = _loaded(client)
    for name in args.models:
        # A loaded model is stopped first so that its runner lets go of the blobs.
        if name in loaded or f"{name}:latest" in loaded:
            try:
                _unload(client, name)
            except ServerError as e:
                sys.stderr.write(f"Warning: unable to stop model '{name}': {e}\n")
        client.call("DELETE", "/api/delete", {"model": name})
        _out(f"deleted '{name}'\n")
    return 0


def cmd_stop(args: argparse.Namespace, client: Client) -> int:
    try:
        _unload(client, args.model)
    except ServerError as e:
        if e.status == 404:
            raise ServerError(f'couldn\'t find model "{args.model}" to stop', 404) from None
        raise
    return 0


def transfer(client: Client, path: str, model: str, insecure: bool = False) -> None:
    """Streams a pull or push with progress on stderr."""
    body: dict[str, Any] = {"model": model, "stream": True}
    if insecure:
        body["insecure"] = True
    registry = _registry()
    if registry:
        # This shell's FREETOKEN_REGISTRY, as Ollama's CLI honours its own OLLAMA_HOST: the
        # server may have been started without it (or with another).
        body["registry"] = registry
    progress = Progress()
    try:
        for event in client.stream(path, body):
            progress.event(event)
    finally:
        progress.close()


def _registry() -> str:
    from freetoken import config

    return config.current().registry


def cmd_pull(args: argparse.Namespace, client: Client) -> int:
    transfer(client, "/api/pull", args.model, args.insecure)
    return 0


def cmd_push(args: argparse.Namespace, client: Client) -> int:
    _check_namespace(args.model)
    transfer(client, "/api/push", args.model, args.insecure)
    return 0


def _check_namespace(model: str) -> None:
    """A push names its namespace: a bare name would land in `library/`, the registry's own
    models, where Ollama's registry refuses it and another registry mixes it with them."""
    path = model.split("://", 1)[-1].split("@", 1)[0]
    if path.count("/") == 0:
        raise CommandError(
            f"push needs a namespace: copy the model under yours first "
            f"(freetoken cp {model} YOURNAME/{model}), then push YOURNAME/{model}"
        )


def cmd_create(args: argparse.Namespace, client: Client) -> int:
    # The store package (Modelfile parser) is only needed here; other verbs start faster without it.
    from freetoken.cli.create import create

    create(client, args.model, Path(args.file), Progress(), args.quantize)
    return 0


def cmd_version(args: argparse.Namespace, client: Client) -> int:
    # The server reports the Ollama API version it follows; compare like with like.
    api = freetoken.OLLAMA_VERSION
    try:
        server = (client.call("GET", "/api/version") or {}).get("version")
    except (NotRunning, ServerError) as e:
        sys.stderr.write(f"Warning: {e}\n")
        server = None
    _out(f"freetoken version is {freetoken.__version__} (Ollama API {api})\n")
    if server and server != api:
        sys.stderr.write(
            f"Warning: the server reports version {server}, this client was built for {api}\n"
        )
    return 0


def cmd_serve(args: argparse.Namespace, client: Client | None) -> int:
    from freetoken import server

    try:
        server.serve()
    except server.BindError as e:
        raise CommandError(str(e)) from None
    return 0
