"""The registry's HTTP face: the subset of the OCI distribution API that FreeToken's pull
and push (and Ollama's client) speak, as docs/architecture.md "The registry protocol" lists.

Reads are open. Writes (POST, PATCH, PUT, DELETE) need `Authorization: Bearer <token>` when
the app was made with a token, and the check comes before any of the body is read.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from freetoken.registry.auth import ChallengeAuth, Guard, token_endpoint
from freetoken.registry.errors import RegistryError, handlers
from freetoken.registry.storage import Storage, Upload, check_repo, check_tag, manifest_digest
from freetoken.store import manifest as mf
from freetoken.store.blobs import DigestMismatch
from freetoken.store.names import InvalidName, parse_digest

__all__ = ["create_app", "routes"]

Endpoint = Callable[[Request], Awaitable[Response]]

# Bytes gathered before one write (and hash) in a worker thread, and read per chunk sent.
_CHUNK = 1 << 20
# As the OCI distribution spec suggests: a manifest is small, and a huge one is an attack.
_MAX_MANIFEST = 4 << 20
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_CONTENT_RANGE = re.compile(r"(?:bytes[ =])?(\d+)-(\d+)(?:/(?:\d+|\*))?")


# -- request parts -------------------------------------------------------------------------


def _storage(request: Request) -> Storage:
    return request.app.state.storage


def _repo(request: Request) -> tuple[str, str]:
    namespace, model = request.path_params["namespace"], request.path_params["model"]
    try:
        check_repo(namespace, model)
    except InvalidName:
        raise RegistryError(
            400, "NAME_INVALID", f"invalid repository name {namespace}/{model}"
        ) from None
    return namespace, model


def _digest(text: str) -> str:
    try:
        return parse_digest(text)
    except InvalidName:
        raise RegistryError(400, "DIGEST_INVALID", f"invalid digest {text!r}") from None


async def _body(request: Request, code: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect:
        # Nobody will read this answer; raising it unwinds the handler without a traceback.
        raise RegistryError(400, code, "the request body ended early") from None


def _write(endpoint: Endpoint) -> Endpoint:
    """Guards a write with the app's token, if it has one."""

    @functools.wraps(endpoint)
    async def guarded(request: Request) -> Response:
        token: str | None = request.app.state.token
        if token:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), token.encode()
            ):
                raise RegistryError(
                    401,
                    "UNAUTHORIZED",
                    "authentication required",
                    headers={"WWW-Authenticate": 'Bearer realm="freetoken"'},
                )
        return await endpoint(request)

    return guarded


# -- read-only -----------------------------------------------------------------------------


async def version_check(request: Request) -> Response:
    return JSONResponse({})


async def catalog(request: Request) -> Response:
    return JSONResponse({"repositories": _storage(request).catalog()})


async def tags_list(request: Request) -> Response:
    namespace, model = _repo(request)
    found = _storage(request).tags(namespace, model)
    if found is None:
        raise RegistryError(404, "NAME_UNKNOWN", f"repository {namespace}/{model} is not known")
    name, tags = found
    return JSONResponse({"name": name, "tags": tags})


async def get_manifest(request: Request) -> Response:
    namespace, model = _repo(request)
    reference = request.path_params["reference"]
    try:
        data = _storage(request).manifest(namespace, model, reference)
    except InvalidName:
        raise RegistryError(400, "TAG_INVALID", f"invalid tag or digest {reference!r}") from None
    if data is None:
        raise RegistryError(
            404, "MANIFEST_UNKNOWN", f"manifest {namespace}/{model}:{reference} is not known"
        )
    headers = {"Docker-Content-Digest": manifest_digest(data), "Content-Length": str(len(data))}
    body = b"" if request.method == "HEAD" else data
    return Response(body, media_type=mf.MANIFEST, headers=headers)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, stop) of a single `bytes=` range, or None to send the whole blob.

    Anything but one byte range is ignored, as RFC 9110 allows; a range that starts past
    the end (or ends before it starts) raises 416.
    """
    m = _RANGE.fullmatch(header.strip()) if header else None
    if not m or not (m[1] or m[2]):
        return None
    if not m[1]:  # `bytes=-n`: the last n bytes
        if int(m[2]) == 0 or size == 0:
            raise _unsatisfiable(size)
        return max(size - int(m[2]), 0), size
    start = int(m[1])
    last = int(m[2]) if m[2] else size - 1
    if start >= size or last < start:
        raise _unsatisfiable(size)
    return start, min(last, size - 1) + 1


def _unsatisfiable(size: int) -> RegistryError:
    return RegistryError(
        416,
        "RANGE_INVALID",
        f"the range is not within the blob's {size} bytes",
        headers={"Content-Range": f"bytes */{size}"},
    )


def _read_file(path: Path, start: int, stop: int) -> Iterator[bytes]:
    # A plain generator: Starlette runs each step in a worker thread, so a slow disk never
    # stalls the event loop, and only one chunk is in memory at a time.
    with open(path, "rb") as f:
        f.seek(start)
        left = stop - start
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk


async def get_blob(request: Request) -> Response:
    _repo(request)
    digest = _digest(request.path_params["digest"])
    path = _storage(request).blob(digest)
    if path is None:
        raise RegistryError(
            404, "BLOB_UNKNOWN", f"blob {digest} is not known", detail={"digest": digest}
        )
    size = path.stat().st_size
    headers = {
        "Accept-Ranges": "bytes",
        "Docker-Content-Digest": digest,
        "Content-Type": "application/octet-stream",
        "Content-Length": str(size),
    }
    # Range is defined for GET only; a HEAD always reports the whole size.
    if request.method == "HEAD":
        return Response(headers=headers)
    span = parse_range(request.headers.get("range"), size)
    if span is None:
        return StreamingResponse(_read_file(path, 0, size), headers=headers)
    start, stop = span
    headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
    headers["Content-Length"] = str(stop - start)
    return StreamingResponse(_read_file(path, start, stop), status_code=206, headers=headers)


# -- uploads -------------------------------------------------------------------------------


def _upload_headers(upload: Upload) -> dict[str, str]:
    return {
        "Location": f"/v2/{upload.repo}/blobs/uploads/{upload.id}",
        # OCI's inclusive end of what has arrived; "0-0" also stands for nothing yet.
        "Range": f"0-{max(upload.size - 1, 0)}",
        "Docker-Upload-UUID": upload.id,
    }


def _blob_created(repo: str, digest: str) -> Response:
    headers = {"Location": f"/v2/{repo}/blobs/{digest}", "Docker-Content-Digest": digest}
    return Response(status_code=201, headers=headers)


def _open_upload(request: Request) -> Upload:
    namespace, model = _repo(request)
    upload_id = request.path_params["upload_id"]
    upload = _storage(request).upload(upload_id, f"{namespace}/{model}")
    if upload is None or upload.closed:
        raise RegistryError(404, "BLOB_UPLOAD_UNKNOWN", f"upload {upload_id!r} is not known")
    return upload


async def _receive(request: Request, upload: Upload) -> int:
    """Appends the body in large writes off the event loop, one in flight while the next
    buffer fills (writing to disk is usually slower than the socket); returns the bytes."""
    loop = asyncio.get_running_loop()
    received = 0
    pending = bytearray()
    writing: asyncio.Future[None] | None = None
    try:
        async for chunk in _body(request, "BLOB_UPLOAD_INVALID"):
            pending += chunk
            if len(pending) >= _CHUNK:
                if writing is not None:
                    await writing
                writing = loop.run_in_executor(None, upload.append, pending)
                received += len(pending)
                pending = bytearray()
        if writing is not None:
            await writing
        if pending:
            await asyncio.to_thread(upload.append, pending)
            received += len(pending)
    finally:
        # The caller may roll back next, which must not race a write still in flight.
        if writing is not None and not writing.done():
            await asyncio.wait([writing])
    return received


async def _append(request: Request, upload: Upload) -> None:
    """Appends one chunk, all or nothing: a chunk at the wrong offset, of the wrong length
    or cut short leaves the upload as it was, so the client can send it again."""
    expected = None
    header = request.headers.get("content-range")
    if header:
        m = _CONTENT_RANGE.fullmatch(header.strip())
        if not m:
            raise RegistryError(400, "BLOB_UPLOAD_INVALID", f"invalid Content-Range {header!r}")
        start, last = int(m[1]), int(m[2])
        if start != upload.size or last < start:
            raise RegistryError(
                416,
                "RANGE_INVALID",
                f"Content-Range {header!r} does not start at {upload.size}",
                headers=_upload_headers(upload),
            )
        expected = last - start + 1
    mark = upload.mark()
    try:
        received = await _receive(request, upload)
        if expected is not None and received != expected:
            raise RegistryError(
                400,
                "BLOB_UPLOAD_INVALID",
                f"Content-Range {header!r} announced {expected} bytes, got {received}",
            )
    except BaseException:
        upload.rollback(mark)
        raise


async def _publish(storage: Storage, upload: Upload, digest: str) -> Response:
    storage.close(upload)
    try:
        await asyncio.to_thread(storage.publish, upload, digest)
    except DigestMismatch as e:
        raise RegistryError(400, "DIGEST_INVALID", str(e), detail={"digest": digest}) from None
    return _blob_created(upload.repo, digest)


async def start_upload(request: Request) -> Response:
    """POST: a new upload (202); with `?digest=` the whole blob in this body (201); with
    `?mount=` nothing to send when the blob is already here (201), blobs being shared."""
    namespace, model = _repo(request)
    storage = _storage(request)
    query = request.query_params
    if "mount" in query:
        digest = _digest(query["mount"])
        if storage.blob(digest) is not None:
            return _blob_created(f"{namespace}/{model}", digest)
    digest = _digest(query["digest"]) if "digest" in query else None
    upload = storage.start_upload(f"{namespace}/{model}")
    if digest is None:
        return Response(status_code=202, headers=_upload_headers(upload))
    async with upload.lock:
        try:
            await _append(request, upload)
        except BaseException:
            storage.discard(upload)
            raise
        return await _publish(storage, upload, digest)


async def upload_status(request: Request) -> Response:
    return Response(status_code=204, headers=_upload_headers(_open_upload(request)))


async def patch_upload(request: Request) -> Response:
    upload = _open_upload(request)
    async with upload.lock:
        if upload.closed:  # finished or cancelled while this request waited
            raise RegistryError(404, "BLOB_UPLOAD_UNKNOWN", f"upload {upload.id} is not known")
        await _append(request, upload)
    return Response(status_code=202, headers=_upload_headers(upload))


async def finish_upload(request: Request) -> Response:
    upload = _open_upload(request)
    # Checked before the body is read, and a bad parameter leaves the upload open.
    digest = _digest(request.query_params.get("digest", ""))
    async with upload.lock:
        if upload.closed:
            raise RegistryError(404, "BLOB_UPLOAD_UNKNOWN", f"upload {upload.id} is not known")
        await _append(request, upload)
        return await _publish(_storage(request), upload, digest)


async def cancel_upload(request: Request) -> Response:
    upload = _open_upload(request)
    async with upload.lock:
        _storage(request).discard(upload)
    return Response(status_code=204)


# -- manifests -----------------------------------------------------------------------------


async def _manifest_body(request: Request) -> bytes:
    length = request.headers.get("content-length", "")
    too_big = RegistryError(413, "MANIFEST_INVALID", f"a manifest is at most {_MAX_MANIFEST} bytes")
    if length.isdigit() and int(length) > _MAX_MANIFEST:
        raise too_big
    data = bytearray()
    async for chunk in _body(request, "MANIFEST_INVALID"):
        data += chunk
        if len(data) > _MAX_MANIFEST:
            raise too_big
    return bytes(data)


def _check_blobs(storage: Storage, manifest: mf.Manifest) -> None:
    """Every blob the manifest names (config and layers) is here, at the size it says."""
    for layer in (manifest.config, *manifest.layers):
        try:
            digest = parse_digest(layer.digest)
        except InvalidName:
            raise RegistryError(
                400, "MANIFEST_INVALID", f"invalid digest {layer.digest!r}"
            ) from None
        path = storage.blob(digest)
        if path is None:
            raise RegistryError(
                400,
                "MANIFEST_BLOB_UNKNOWN",
                f"blob {digest} is not in the registry",
                detail={"digest": digest},
            )
        size = path.stat().st_size
        if size != layer.size:
            raise RegistryError(
                400,
                "MANIFEST_INVALID",
                f"blob {digest} has {size} bytes, the manifest says {layer.size}",
                detail={"digest": digest},
            )


async def put_manifest(request: Request) -> Response:
    namespace, model = _repo(request)
    tag = request.path_params["reference"]
    try:
        check_tag(tag)
    except InvalidName:
        raise RegistryError(
            400, "TAG_INVALID", f"invalid tag {tag!r} (manifests are pushed by tag)"
        ) from None
    data = await _manifest_body(request)
    try:
        manifest = mf.Manifest.from_bytes(data)
    except mf.ManifestError as e:
        raise RegistryError(400, "MANIFEST_INVALID", str(e)) from None
    storage = _storage(request)
    _check_blobs(storage, manifest)
    digest = await asyncio.to_thread(storage.put_manifest, namespace, model, tag, data)
    headers = {
        "Location": f"/v2/{namespace}/{model}/manifests/{digest}",
        "Docker-Content-Digest": digest,
    }
    return Response(status_code=201, headers=headers)


# -- the app -------------------------------------------------------------------------------

_REPO = "/v2/{namespace}/{model}"
_UPLOAD = _REPO + "/blobs/uploads/{upload_id}"

routes = [
    Route("/v2/", version_check, methods=["GET"]),
    Route("/v2", version_check, methods=["GET"]),
    Route("/v2/_catalog", catalog, methods=["GET"]),
    Route(_REPO + "/tags/list", tags_list, methods=["GET"]),
    Route(_REPO + "/manifests/{reference}", get_manifest, methods=["GET", "HEAD"]),
    Route(_REPO + "/manifests/{reference}", _write(put_manifest), methods=["PUT"]),
    # Without the slash too: that path would otherwise reach the blob route and get a 405.
    Route(_REPO + "/blobs/uploads/", _write(start_upload), methods=["POST"]),
    Route(_REPO + "/blobs/uploads", _write(start_upload), methods=["POST"]),
    Route(_UPLOAD, upload_status, methods=["GET"]),
    Route(_UPLOAD, _write(patch_upload), methods=["PATCH"]),
    Route(_UPLOAD, _write(finish_upload), methods=["PUT"]),
    Route(_UPLOAD, _write(cancel_upload), methods=["DELETE"]),
    Route(_REPO + "/blobs/{digest}", get_blob, methods=["GET", "HEAD"]),
]


def create_app(
    root: str | Path, token: str | None = None, challenge: ChallengeAuth | None = None
) -> Starlette:
    """The registry serving `root` (created if needed; unfinished uploads are dropped).
    With a token, every write must carry it as a Bearer token; with `challenge`, every
    repository request needs a token from GET /token, as Ollama's registry does."""
    storage = Storage(Path(root))
    storage.prepare()
    extra = [Route("/token", token_endpoint(challenge), methods=["GET"])] if challenge else []
    app = Starlette(routes=[*routes, *extra], exception_handlers=handlers)
    if challenge is not None:
        app.add_middleware(Guard, auth=challenge)
    # Both spellings that matter are routed; a redirect would only echo hostile paths back.
    app.router.redirect_slashes = False
    app.state.storage = storage
    app.state.token = token or None
    return app
