"""OCI-style image manifests: `manifests/<host>/<namespace>/<model>/<tag>`.

The layout and media types follow docs/architecture.md. A manifest is written to a temporary
file beside its final path and renamed into place, and only after every blob it names is in
the store, so a model is listed only when it is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "CONFIG",
    "FILE",
    "GGUF",
    "LICENSE",
    "MANIFEST",
    "MESSAGES",
    "PARAMS",
    "SYSTEM",
    "TEMPLATE",
    "Layer",
    "Manifest",
    "ManifestError",
    "read",
    "safe_file_name",
    "write",
]

MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG = "application/vnd.docker.container.image.v1+json"
FILE = "application/vnd.freetoken.file"
GGUF = "application/vnd.ollama.image.model"
TEMPLATE = "application/vnd.ollama.image.template"
SYSTEM = "application/vnd.ollama.image.system"
PARAMS = "application/vnd.ollama.image.params"
MESSAGES = "application/vnd.ollama.image.messages"
LICENSE = "application/vnd.ollama.image.license"


class ManifestError(ValueError):
    """A manifest file that is not valid JSON of the expected shape."""


def safe_file_name(name: object) -> bool:
    """A relative path inside the model directory. A layer's name becomes a file name
    beside the others (a runner's links, a conversion's sources), so `../x`, `/etc/x` or
    a backslash must never be one: every reader and the registry refuse such a manifest."""
    return (
        isinstance(name, str)
        and bool(name)
        and "\\" not in name
        and "\0" not in name
        and not PurePosixPath(name).is_absolute()
        and all(part not in ("", ".", "..") for part in name.split("/"))
    )


@dataclass(frozen=True, slots=True)
class Layer:
    media_type: str
    digest: str
    size: int
    name: str | None = None  # the relative file name, for FILE layers

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
        }
        if self.name is not None:
            out["name"] = self.name
        return out

    @classmethod
    def from_json(cls, obj: Any) -> Layer:
        if not isinstance(obj, dict):
            raise ManifestError("layer is not an object")
        name = obj.get("name")
        if name is not None and not safe_file_name(name):
            raise ManifestError(f"bad layer name {name!r}: not a relative path")
        try:
            return cls(str(obj["mediaType"]), str(obj["digest"]), int(obj["size"]), name)
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"bad layer {obj!r}: {e}") from None


@dataclass(frozen=True, slots=True)
class Manifest:
    config: Layer
    layers: tuple[Layer, ...] = field(default_factory=tuple)

    def to_bytes(self) -> bytes:
        obj = {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": self.config.to_json(),
            "layers": [layer.to_json() for layer in self.layers],
        }
        return json.dumps(obj, indent=2).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest is not JSON: {e}") from None
        if not isinstance(obj, dict) or obj.get("schemaVersion") != 2 or "config" not in obj:
            raise ManifestError("not a schemaVersion 2 manifest")
        layers = obj.get("layers") or []
        if not isinstance(layers, list):
            raise ManifestError("layers is not a list")
        return cls(Layer.from_json(obj["config"]), tuple(Layer.from_json(x) for x in layers))

    def digests(self) -> set[str]:
        """Every blob the manifest references, the config included."""
        return {self.config.digest, *(layer.digest for layer in self.layers)}

    @property
    def size(self) -> int:
        """What /api/tags reports: the sum of the layer sizes (config included, as Ollama does)."""
        return self.config.size + sum(layer.size for layer in self.layers)

    def by_type(self, media_type: str) -> list[Layer]:
        return [layer for layer in self.layers if layer.media_type == media_type]


def read(path: Path) -> tuple[Manifest, str]:
    """The manifest and the sha256 hex of its bytes (its digest in /api/tags)."""
    data = Path(path).read_bytes()
    return Manifest.from_bytes(data), hashlib.sha256(data).hexdigest()


def write(path: Path, manifest: Manifest) -> str:
    """Writes atomically (temp file, fsync, rename); returns the sha256 hex of the bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = manifest.to_bytes()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return hashlib.sha256(data).hexdigest()
