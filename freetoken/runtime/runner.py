"""The runner process: one loaded model behind a small HTTP protocol on a Unix socket.

    python -m freetoken.runtime.runner --socket PATH --spec SPEC.json [--parent-pid PID]

The protocol is described in docs/architecture.md. The model loads on a background
thread while /health reports progress; one engine thread runs steps; HTTP handlers only
submit sequences and relay their output.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from freetoken import config as settings
from freetoken import jsonline
from freetoken.protocol import CompletionRequest, ProtocolError
from freetoken.runtime.service import ModelService, RequestError

log = logging.getLogger("freetoken.runner")


def _json_body(raw: bytes) -> dict[str, Any]:
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _endpoint(handle: Callable[[dict[str, Any], asyncio.AbstractEventLoop], Any]):
    """A POST route: JSON object in; the handler's answer out (a JSON object, or a response
    it built); bad JSON and RequestError become {"error"} with their status."""

    async def route(request: Request):
        try:
            result = handle(_json_body(await request.body()), asyncio.get_running_loop())
            if inspect.isawaitable(result):
                result = await result
        except json.JSONDecodeError as e:
            return JSONResponse({"error": f"invalid JSON: {e}"}, status_code=400)
        except RequestError as e:
            return JSONResponse({"error": str(e)}, status_code=e.status)
        except ProtocolError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        return result if isinstance(result, Response) else JSONResponse(result)

    return route


def build_app(service: ModelService) -> Starlette:
    async def health(_: Request) -> JSONResponse:
        return JSONResponse(service.health())

    async def stats(_: Request) -> JSONResponse:
        return JSONResponse(service.stats())

    async def completion(body: dict[str, Any], _: asyncio.AbstractEventLoop) -> Response:
        handle = await service.start(CompletionRequest.from_json(body))
        return StreamingResponse(_ndjson(service, handle), media_type="application/x-ndjson")

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/completion", _endpoint(completion), methods=["POST"]),
        Route("/resize", _endpoint(lambda body, _: service.resize(body)), methods=["POST"]),
        Route("/embed", _endpoint(lambda body, _: service.embed(body)), methods=["POST"]),
        Route(
            "/tokenize",
            _endpoint(lambda body, _: service.tokenize(CompletionRequest.from_json(body))),
            methods=["POST"],
        ),
    ]
    return Starlette(routes=routes)


async def _ndjson(service: ModelService, handle):
    try:
        async for event in handle.events():
            yield jsonline.dumps(event) + "\n"
    finally:
        # Runs on normal completion and when the client goes away (generator closed).
        service.cancel(handle)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the server that started us is gone, so runners never outlive it."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="freetoken-runner")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--spec", required=True)
    ap.add_argument("--parent-pid", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = settings.current()
    logging.basicConfig(
        level=logging.DEBUG if cfg.debug else logging.INFO,
        format="%(asctime)s runner %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    spec: dict[str, Any] = json.loads(Path(args.spec).read_text())
    service = ModelService(spec, cfg)
    # imported before the engine thread starts importing too (imports racing across threads
    # is where a runner once failed to find a standard module)
    import uvicorn

    threading.Thread(target=service.load_and_run, name="engine", daemon=True).start()
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    server = uvicorn.Server(
        uvicorn.Config(build_app(service), uds=args.socket, log_level="warning", lifespan="off")
    )
    server.run()


if __name__ == "__main__":
    main()
