"""`freetoken run`: make sure the model exists (pulling it if not), then answer one prompt
through /api/generate or open the interactive chat over /api/chat."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from freetoken import config
from freetoken.cli.client import Client
from freetoken.cli.commands import transfer
from freetoken.cli.errors import CommandError, ServerError
from freetoken.cli.interactive import History, Repl
from freetoken.cli.session import Session, parse_think, stream_reply

__all__ = ["cmd_run", "ensure_model", "session_from_args"]


def ensure_model(client: Client, model: str, insecure: bool = False) -> dict[str, Any]:
    """The model's /api/show answer; a model the store lacks is pulled first, as Ollama does."""
    try:
        return client.call("POST", "/api/show", {"model": model}) or {}
    except ServerError as e:
        if e.status != 404:
            raise
    transfer(client, "/api/pull", model, insecure)
    return client.call("POST", "/api/show", {"model": model}) or {}


def session_from_args(args: argparse.Namespace) -> Session:
    if args.format not in (None, "", "json"):
        raise CommandError(f"invalid format {args.format!r}: only 'json' is supported")
    if args.keepalive is not None:
        try:
            config.parse_duration(args.keepalive)
        except ValueError as e:
            raise CommandError(f"invalid --keepalive: {e}") from None
    return Session(
        model=args.model,
        format=args.format or None,
        think=parse_think(args.think),
        hide_thinking=args.hidethinking,
        verbose=args.verbose,
        wordwrap=not args.nowordwrap,
        keep_alive=args.keepalive,
    )


def _history() -> History:
    cfg = config.current()
    if cfg.nohistory:
        return History(None)
    path = cfg.history_file
    if path is None:
        import platformdirs

        path = Path(platformdirs.user_data_dir("freetoken")) / "history"
    return History(path)


_SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def loading_line(model: str, row: dict[str, Any] | None, tick: int, elapsed: float) -> str:
    """`loading NAME ⠹ 3s` until bytes move (a runner starting, a kernel building), then the
    bytes and their rate; the spinner turns either way, so a slow start never looks frozen."""
    spin = _SPINNER[tick % len(_SPINNER)]
    if not row or not row.get("completed"):
        return f"loading {model} {spin} {int(elapsed)}s"
    line = f"loading {row.get('name', model)} {spin} {row['completed'] / 1e9:.2f}/"
    line += f"{row['total'] / 1e9:.2f} GB"
    if row.get("gbps"):
        line += f" ({row['gbps']:.2f} GB/s)"
    return line


def load_with_progress(client: Client, session: Session, err: TextIO) -> None:
    """Loads the model, showing the server's byte progress (GB and GB/s) while it reads."""
    preload: dict[str, Any] = {"model": session.model}
    if session.keep_alive is not None:
        preload["keep_alive"] = session.keep_alive
    failure: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            for _ in client.stream("/api/generate", preload):
                pass
        except BaseException as e:  # re-raised on the calling thread
            failure.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    shown = False
    show = err.isatty()  # progress is for people, not for logs
    start, tick = time.monotonic(), 0
    while not done.wait(0.25):
        if not show:
            continue
        try:
            rows = (client.call("GET", "/api/loading") or {}).get("models", [])
        except ServerError:
            continue
        row = next((r for r in rows if r.get("total")), None)
        err.write("\r\033[K" + loading_line(session.model, row, tick, time.monotonic() - start))
        err.flush()
        shown, tick = True, tick + 1
    if shown:
        err.write("\r\033[K")
    if failure:
        raise failure[0]


def cmd_run(
    args: argparse.Namespace,
    client: Client,
    stdin: TextIO | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    session = session_from_args(args)
    ensure_model(client, args.model, args.insecure)
    interactive = stdin.isatty()
    # Piped input is the prompt (followed by any prompt words), as with `ollama run`.
    parts = [] if interactive else [stdin.read()]
    parts.append(" ".join(args.prompt))
    prompt = " ".join(p for p in parts if p)
    # Load first, with visible progress, so the answer's timing is the answer's alone.
    load_with_progress(client, session, err)
    if prompt or not interactive:
        stream_reply(client, "/api/generate", session.generate_body(prompt), session, out, err)
        return 0
    history = _history()
    try:
        return Repl(client, session, out=out, err=err, history=history).run()
    finally:
        history.save()
