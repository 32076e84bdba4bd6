"""`freetoken create`: the Modelfile is parsed here, its files are uploaded as blobs, and
the server gets a JSON /api/create request, as Ollama's client does.

A server on this machine (a loopback address) is first offered the files in place:
`local_files` names each with the size and modification time seen here, and a server that
sees the same files reads them where they are (it converts them, or links FTW files into
its store) instead of receiving every byte over HTTP. One that cannot (another mount
namespace, a service user who may not read them) answers 412, and the files are uploaded.

FROM (and ADAPTER) paths are resolved against the Modelfile's directory, not the current
one, so a Modelfile and its weights can be moved together.
"""

from __future__ import annotations

import fnmatch
import hashlib
from pathlib import Path
from typing import Any

from freetoken import gguf_split
from freetoken.cli.client import Client
from freetoken.cli.errors import CommandError, ServerError
from freetoken.cli.progress import Progress
from freetoken.store import modelfile as mfmod
from freetoken.store.names import InvalidName, Name

__all__ = ["build_request", "create", "digest_file", "model_files", "resolve_path"]

# What a model directory may contribute: config and tokenizer files, weights (safetensors,
# FTW shards, GGUF) and the chat template. Anything else (READMEs, images) stays behind.
MODEL_FILE_PATTERNS = (
    "*.json",
    "*.safetensors",
    "ftw-*.bin",  # FTW shards (docs/ftw.md)
    "*.gguf",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
)
_PATH_PREFIXES = ("./", "../", "/", "~", ".\\", "..\\")


def digest_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return "sha256:" + h.hexdigest()


def _looks_like_path(value: str) -> bool:
    if value in (".", "..") or value.startswith(_PATH_PREFIXES):
        return True
    if value.lower().endswith((".gguf", ".safetensors")):
        return True
    try:
        Name.parse(value)
    except InvalidName:
        return True
    return False


def resolve_path(value: str, base: Path, what: str = "FROM") -> Path | None:
    """The file or directory `value` names relative to `base`, or None if it is a model name.

    An existing path wins over a model of the same name, as in Ollama.
    """
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base / path
    if path.exists():
        return path
    if _looks_like_path(value):
        raise CommandError(f"invalid {what}: path '{path}' does not exist")
    return None


def model_files(directory: Path) -> list[Path]:
    files = [
        p
        for p in sorted(directory.iterdir())
        if not p.name.startswith(".")
        and p.is_file()
        and any(fnmatch.fnmatch(p.name, pat) for pat in MODEL_FILE_PATTERNS)
    ]
    if not files:
        raise CommandError(f"no model files found in '{directory}'")
    return files


def _local_files(path: Path) -> list[tuple[str, Path]]:
    if path.is_dir():
        return [(p.name, p) for p in model_files(path)]
    if path.suffix.lower() == ".gguf":  # every part, where it is one of a split file's
        try:
            return [(p.name, p) for p in gguf_split.parts(path)]
        except gguf_split.MissingParts as e:
            raise CommandError(str(e)) from None
    raise CommandError(f"'{path}' is neither a model directory nor a .gguf file")


def _upload(client: Client, files: list[tuple[str, Path]], progress: Progress) -> dict[str, str]:
    """Uploads each file the server lacks; returns {relative name: digest}."""
    digests: dict[str, str] = {}
    for name, path in files:
        digest = digest_file(path)
        digests[name] = digest
        size = path.stat().st_size
        label = f"copying file {digest}"
        if not client.blob_exists(digest):

            def sent(n: int, d: str = digest, lb: str = label, total: int = size) -> None:
                progress.bar(d, lb, n, total, percent_only=True)

            client.upload_blob(digest, path, sent)
        # An empty file or a blob the server already has still gets its 100% line.
        progress.bar(digest, label, max(size, 1), max(size, 1), percent_only=True)
    return digests


def _in_place(files: list[tuple[str, Path]]) -> dict[str, dict[str, Any]]:
    """The `local_files` field: each file's absolute path, size and modification time."""
    out = {}
    for name, path in files:
        st = path.stat()
        out[name] = {"path": str(path.absolute()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


def build_request(
    client: Client,
    name: str,
    modelfile_path: Path,
    progress: Progress,
    quantize: str | None = None,
    in_place: bool | None = None,
) -> dict[str, Any]:
    """Parses the Modelfile, uploads what it refers to (or, `in_place`, names the files for
    the server to read; default: where the server is on this machine), and returns the
    /api/create body."""
    try:
        text = modelfile_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CommandError(f"Modelfile '{modelfile_path}' not found") from None
    except OSError as e:
        raise CommandError(f"cannot read Modelfile '{modelfile_path}': {e.strerror}") from None
    try:
        mf = mfmod.parse(text)
    except ValueError as e:
        raise CommandError(f"{modelfile_path}: {e}") from None
    base = modelfile_path.resolve().parent
    request: dict[str, Any] = {"model": name}
    source = resolve_path(mf.from_, base)
    progress.status("gathering model components")
    in_place = client.is_local if in_place is None else in_place
    if source is None:
        request["from"] = mf.from_
    elif in_place:
        request["local_files"] = _in_place(_local_files(source))
    else:
        request["files"] = _upload(client, _local_files(source), progress)
    adapters: dict[str, str] = {}
    for value in mf.adapters:
        adapter = resolve_path(value, base, "ADAPTER")
        if adapter is None:
            raise CommandError(f"invalid ADAPTER: '{value}' is not a file or directory")
        adapters.update(_upload(client, _local_files(adapter), progress))
    if adapters:
        request["adapters"] = adapters
    request.update(_modelfile_fields(mf))
    if quantize:
        request["quantize"] = quantize
    return request


def _modelfile_fields(mf: mfmod.Modelfile) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key in ("template", "system", "requires", "renderer", "parser"):
        value = getattr(mf, key)
        if value is not None:
            fields[key] = value
    if mf.parameters:
        fields["parameters"] = dict(mf.parameters)
    if mf.messages:
        fields["messages"] = list(mf.messages)
    if mf.license:
        fields["license"] = mf.license[0] if len(mf.license) == 1 else list(mf.license)
    return fields


def create(
    client: Client,
    name: str,
    modelfile_path: Path,
    progress: Progress,
    quantize: str | None = None,
    in_place: bool | None = None,
) -> None:
    """`freetoken create`; `in_place` as build_request's."""
    try:
        request = build_request(client, name, modelfile_path, progress, quantize, in_place)
        try:
            _stream(client, request, progress)
        except ServerError as e:
            if e.status != 412 or "local_files" not in request:
                raise
            # the server cannot read the files where they are: send them
            progress.status(f"uploading: {e}")
            local = request.pop("local_files")
            files = [(n, Path(f["path"])) for n, f in local.items()]
            request["files"] = _upload(client, files, progress)
            _stream(client, request, progress)
    finally:
        progress.close()


def _stream(client: Client, request: dict[str, Any], progress: Progress) -> None:
    for event in client.stream("/api/create", request):
        progress.event(event)
