"""Ollama's model-management routes: version, tags, show, ps, create, blobs, copy, delete,
pull and push.

/api/generate and /api/chat live in `completion.py`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from freetoken import OLLAMA_VERSION, config_values
from freetoken import pull as transfer
from freetoken.api.errors import APIError, handler
from freetoken.api.state import resolve, services
from freetoken.api.stream import NDJSONResponse
from freetoken.api.types import field_of, parse_json
from freetoken.options import OptionError
from freetoken.store import CreateSpec, InvalidName, LocalFile, ModelNotFound, Name, modelfile
from freetoken.store.names import parse_digest

__all__ = [
    "blob_exists",
    "blob_upload",
    "copy",
    "create",
    "delete",
    "ps",
    "pull",
    "push",
    "root",
    "show",
    "tags",
    "version",
]

_UPLOAD_BUFFER = 8 << 20


async def root(request: Request) -> Response:
    return PlainTextResponse("Ollama is running")


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


@handler
async def tags(request: Request) -> Response:
    models = await run_in_threadpool(services(request).store.list_models)
    return JSONResponse({"models": models})


@handler
async def ps(request: Request) -> Response:
    residency = services(request).residency
    await residency.refresh()  # sizes as they are now, after any resize of a cache
    return JSONResponse({"models": residency.ps()})


@handler
async def loading(request: Request) -> Response:
    """FreeToken's own: byte progress of models being loaded (the CLI shows it)."""
    return JSONResponse({"models": services(request).residency.loading()})


def _model_name(body: dict[str, Any]) -> str:
    # Older clients (and OpenClaw) send `name` instead of `model`.
    name = field_of(body, "model", str) or field_of(body, "name", str)
    if not name:
        raise APIError(400, "model is required")
    return name


@handler
async def show(request: Request) -> Response:
    svc = services(request)
    view = await resolve(svc, _model_name(parse_json(await request.body())))
    return JSONResponse(await run_in_threadpool(svc.store.show, view))


def _modelfile_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The older create form: Modelfile text in `modelfile`; JSON fields given too win."""
    text = field_of(body, "modelfile", str)
    if not text:
        return body
    try:
        mf = modelfile.parse(text)
    except (modelfile.ModelfileError, OptionError) as e:
        raise APIError(400, f"invalid Modelfile: {e}") from None
    if mf.adapters:
        raise APIError(400, "adapters are not supported yet")
    source = mf.from_
    base = field_of(body, "path", str)  # where the Modelfile was: relative FROM paths start there
    if base and source.startswith(("./", "../")):
        source = str(Path(base).expanduser().parent / source)
    fields = {
        "from": source,
        "template": mf.template,
        "system": mf.system,
        "parameters": mf.parameters or None,
        "messages": mf.messages or None,
        "license": mf.license or None,
    }
    return {
        **{k: v for k, v in fields.items() if v is not None},
        **{k: v for k, v in body.items() if v is not None and k != "modelfile"},
    }


def _local_files(body: dict[str, Any]) -> dict[str, LocalFile] | None:
    """FreeToken's `local_files`: {name: {path, size, mtime_ns}}, files a client on this
    machine offers to have read in place instead of uploaded."""
    files = field_of(body, "local_files", dict)
    if not files:
        return None
    out = {}
    for name, f in files.items():
        ok = isinstance(f, dict) and isinstance(f.get("path"), str)
        ok = ok and all(type(f.get(k)) is int for k in ("size", "mtime_ns"))
        if not ok:
            want = "path, size and mtime_ns"
            raise APIError(400, f'invalid value for "local_files": {name!r} needs {want}')
        out[name] = LocalFile(f["path"], f["size"], f["mtime_ns"])
    return out


def _create_spec(body: dict[str, Any]) -> CreateSpec:
    name = _model_name(body)
    body = _modelfile_fields(body)
    if body.get("adapters"):
        raise APIError(400, "adapters are not supported yet")
    files = field_of(body, "files", dict)
    if files and not all(isinstance(v, str) for v in files.values()):
        raise APIError(400, 'invalid value for "files": expected digests as strings')
    messages = field_of(body, "messages", list)
    license_ = field_of(body, "license", (str, list))
    if isinstance(license_, list) and not all(isinstance(x, str) for x in license_):
        raise APIError(400, 'invalid value for "license": expected a string or strings')
    return CreateSpec(
        name=name,
        from_=field_of(body, "from", str),
        files=files,
        local_files=_local_files(body),
        template=field_of(body, "template", str),
        system=field_of(body, "system", str),
        parameters=field_of(body, "parameters", dict),
        messages=messages,
        license=license_,
        quantize=field_of(body, "quantize", str),
    )


def _from_this_machine(request: Request) -> bool:
    """The client connects over loopback: only it may name files for the server to read
    (to a client elsewhere, which files this machine has is none of its business)."""
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@handler
async def create(request: Request) -> Response:
    svc = services(request)
    body = parse_json(await request.body())
    spec = _create_spec(body)
    if spec.local_files and not _from_this_machine(request):
        raise APIError(412, "files are read in place only for clients on this machine")
    # Checked before the response starts, so a bad request gets its status code.
    plan = await run_in_threadpool(svc.store.plan_create, spec)
    progress = iterate_in_threadpool(plan.run())
    return NDJSONResponse(progress, stream=field_of(body, "stream", bool, True))


def _digest(request: Request) -> str:
    try:
        return parse_digest(request.path_params["digest"])
    except InvalidName as e:
        raise APIError(400, str(e)) from None


@handler
async def blob_exists(request: Request) -> Response:
    store = services(request).store
    digest = _digest(request)
    # A client asks before it names the blob in a create: from now until that create, no
    # other create's clean-up may take it.
    if not store.claim(digest, if_present=True):
        raise APIError(404, f'blob "{digest}" not found')
    return Response(status_code=200)


@handler
async def blob_upload(request: Request) -> Response:
    store = services(request).store
    digest = _digest(request)
    if store.claim(digest):  # claimed before the bytes land, so no clean-up sees it unclaimed
        return Response(status_code=200)
    try:
        created = await _receive(request, store.blobs.writer(digest))
    except BaseException:
        store.release([digest])
        raise
    return Response(status_code=201 if created else 200)


async def _receive(request: Request, writer: Any) -> bool:
    with writer:
        buffered: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            buffered.append(chunk)
            size += len(chunk)
            if size >= _UPLOAD_BUFFER:
                await anyio.to_thread.run_sync(writer.write, b"".join(buffered))
                buffered, size = [], 0
        await anyio.to_thread.run_sync(writer.write, b"".join(buffered))
        _, created = await run_in_threadpool(writer.commit)
    return created


@handler
async def copy(request: Request) -> Response:
    svc = services(request)
    body = parse_json(await request.body())
    source = field_of(body, "source", str)
    destination = field_of(body, "destination", str)
    if not source or not destination:
        raise APIError(400, "source and destination are required")
    try:
        Name.parse(destination)
    except InvalidName:
        raise APIError(400, f'destination "{destination}" is invalid') from None
    try:
        await run_in_threadpool(svc.store.copy, source, destination)
    except (ModelNotFound, InvalidName):
        raise APIError(404, f'model "{source}" not found') from None
    return Response(status_code=200)


@handler
async def delete(request: Request) -> Response:
    svc = services(request)
    name = _model_name(parse_json(await request.body()))
    view = await resolve(svc, name)
    await svc.residency.unload(view)
    try:
        await run_in_threadpool(svc.store.delete, name)
    except ModelNotFound:  # deleted by a concurrent request
        raise APIError(404, f"model '{name}' not found") from None
    return Response(status_code=200)


async def _in_threads(events: Iterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """A blocking progress generator, stepped in worker threads and always closed, so a
    client that goes away releases its downloads (and stops a download no one else waits on)."""
    try:
        async for event in iterate_in_threadpool(events):
            yield event
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(close)


def _transfer_args(svc: Any, body: dict[str, Any]) -> tuple[str, bool, bool, Any]:
    """(name, insecure, stream, settings); FreeToken's `registry` field (the CLI's own
    FREETOKEN_REGISTRY) stands in for the server's default registry."""
    name = _model_name(body)
    insecure = bool(field_of(body, "insecure", bool, False))
    cfg = svc.cfg
    registry = field_of(body, "registry", str, "")
    if registry:
        try:
            cfg = dataclasses.replace(cfg, registry=config_values.parse_registry(registry))
        except ValueError as e:
            raise APIError(400, f"registry: {e}") from None
    # A malformed name is a 400 before the stream starts; registry errors arrive in it.
    transfer.locate(name, cfg.registry, insecure)
    return name, insecure, field_of(body, "stream", bool, True), cfg


@handler
async def pull(request: Request) -> Response:
    svc = services(request)
    name, insecure, stream, cfg = _transfer_args(svc, parse_json(await request.body()))
    events = transfer.pull(svc.store, name, insecure, cfg=cfg)
    return NDJSONResponse(_in_threads(events), stream=stream)


@handler
async def push(request: Request) -> Response:
    svc = services(request)
    name, insecure, stream, cfg = _transfer_args(svc, parse_json(await request.body()))
    await resolve(svc, name)  # an unknown model is a 404 before the stream starts
    events = transfer.push(svc.store, name, insecure, cfg=cfg)
    return NDJSONResponse(_in_threads(events), stream=stream)
