"""What travels between a registry and the store: wire manifests and remote names.

A wire manifest is the store's manifest, except that large files travel zstd-compressed
as `application/vnd.freetoken.file+zstd` layers that also carry the file's own digest and
size (docs/architecture.md, "The registry protocol"). `WireLayer.local` is the layer the
store keeps for it.

A compressed file is cut into frames of `frame_size` bytes, each compressed on its own,
and the layer's annotations list the compressed size of every frame, so a pull can
decompress each ranged part as it arrives. A layer without that table (pushed as one
frame) is still read: it is decompressed front to back once it has arrived.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

from freetoken.store import manifest as mf
from freetoken.store.names import DEFAULT_HOST, InvalidName, Name, parse_digest

__all__ = [
    "FRAMES",
    "FRAME_SIZE",
    "ZSTD",
    "Remote",
    "WireLayer",
    "WireManifest",
    "is_loopback",
    "locate",
]

ZSTD = mf.FILE + "+zstd"
# Annotations of a +zstd layer in independent frames: the uncompressed bytes of every frame
# but the last, and the compressed size of each frame in order, as decimal text
# (annotation values are strings).
FRAME_SIZE = "org.freetoken.zstd.frame-size"
FRAMES = "org.freetoken.zstd.frames"
MAX_FRAME_SIZE = 1 << 28  # a pull holds a few frames per stream in memory


@dataclass(frozen=True, slots=True)
class WireLayer:
    media_type: str
    digest: str
    size: int
    name: str | None = None
    uncompressed_digest: str | None = None  # ZSTD layers only: the file's own digest
    uncompressed_size: int | None = None
    frame_size: int | None = None  # framed ZSTD layers only
    frames: tuple[int, ...] = ()

    @property
    def compressed(self) -> bool:
        return self.media_type == ZSTD

    @property
    def framed(self) -> bool:
        """Compressed in independent frames whose sizes are known."""
        return self.compressed and bool(self.frames)

    @property
    def local(self) -> mf.Layer:
        """The layer as the store keeps it (files uncompressed)."""
        if self.compressed:
            assert self.uncompressed_digest is not None and self.uncompressed_size is not None
            return mf.Layer(mf.FILE, self.uncompressed_digest, self.uncompressed_size, self.name)
        return mf.Layer(self.media_type, self.digest, self.size, self.name)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
        }
        if self.name is not None:
            out["name"] = self.name
        if self.compressed:
            out["uncompressed_digest"] = self.uncompressed_digest
            out["uncompressed_size"] = self.uncompressed_size
        if self.framed:
            out["annotations"] = {
                FRAME_SIZE: str(self.frame_size),
                FRAMES: ",".join(map(str, self.frames)),
            }
        return out

    @classmethod
    def from_json(cls, obj: Any) -> WireLayer:
        if not isinstance(obj, dict):
            raise mf.ManifestError("layer is not an object")
        try:
            layer = cls(
                media_type=str(obj["mediaType"]),
                digest=parse_digest(str(obj["digest"])),
                size=_size(obj["size"]),
                name=obj.get("name"),
                uncompressed_digest=_opt_digest(obj.get("uncompressed_digest")),
                uncompressed_size=_opt_size(obj.get("uncompressed_size")),
                **_frame_table(obj.get("annotations")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise mf.ManifestError(f"bad layer {json.dumps(obj)[:200]}: {e}") from None
        name = layer.name
        if name is not None and not mf.safe_file_name(name):
            raise mf.ManifestError(f"bad layer name {name!r}")
        if layer.media_type in (mf.FILE, ZSTD) and layer.name is None:
            raise mf.ManifestError(f"file layer {layer.digest} has no name")
        if layer.compressed and None in (layer.uncompressed_digest, layer.uncompressed_size):
            raise mf.ManifestError(
                f"compressed layer {layer.digest} lacks uncompressed_digest/size"
            )
        if layer.frames and not layer.compressed:
            layer = cls(layer.media_type, layer.digest, layer.size, layer.name)
        if layer.framed and not _table_fits(layer):
            raise mf.ManifestError(f"the frame table of {layer.digest} does not fit its sizes")
        return layer

    @classmethod
    def of(cls, layer: mf.Layer) -> WireLayer:
        """A store layer sent as it is."""
        return cls(layer.media_type, layer.digest, layer.size, layer.name)


def _size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"size {value!r} is not a byte count")
    return value


def _opt_size(value: Any) -> int | None:
    return None if value is None else _size(value)


def _opt_digest(value: Any) -> str | None:
    return None if value is None else parse_digest(str(value))


def _frame_table(annotations: Any) -> dict[str, Any]:
    """frame_size and frames from a layer's annotations; nothing when it has no table."""
    if not isinstance(annotations, dict) or FRAMES not in annotations:
        return {}
    size, table = str(annotations.get(FRAME_SIZE, "")), str(annotations[FRAMES])
    if not size.isdigit() or not all(x.isdigit() for x in table.split(",")):
        raise ValueError("the frame table is not decimal numbers")
    return {"frame_size": int(size), "frames": tuple(int(x) for x in table.split(","))}


def _table_fits(layer: WireLayer) -> bool:
    """Frames that tile the compressed blob, one per frame_size bytes of the file, none
    larger than zstd can make of its bytes (a pull sizes its buffers by the table)."""
    fsize, usize = layer.frame_size or 0, layer.uncompressed_size or 0
    largest = fsize + (fsize >> 7) + (1 << 17)  # above zstd's bound for fsize bytes
    return (
        0 < fsize <= MAX_FRAME_SIZE
        and usize > 0
        and all(0 < n <= largest for n in layer.frames)
        and sum(layer.frames) == layer.size
        and len(layer.frames) == -(-usize // fsize)
    )


@dataclass(frozen=True, slots=True)
class WireManifest:
    config: WireLayer
    layers: tuple[WireLayer, ...]

    def to_bytes(self) -> bytes:
        obj = {
            "schemaVersion": 2,
            "mediaType": mf.MANIFEST,
            "config": self.config.to_json(),
            "layers": [layer.to_json() for layer in self.layers],
        }
        return json.dumps(obj, indent=2).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> WireManifest:
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise mf.ManifestError(f"manifest is not JSON: {e}") from None
        if not isinstance(obj, dict) or obj.get("schemaVersion") != 2 or "config" not in obj:
            raise mf.ManifestError("not a schemaVersion 2 manifest")
        layers = obj.get("layers") or []
        if not isinstance(layers, list):
            raise mf.ManifestError("layers is not a list")
        return cls(
            WireLayer.from_json(obj["config"]), tuple(WireLayer.from_json(x) for x in layers)
        )

    def blobs(self) -> list[WireLayer]:
        """Every blob to fetch, the config first (as Ollama lists them), each digest once."""
        seen: set[str] = set()
        out = []
        for layer in (self.config, *self.layers):
            if layer.digest not in seen:
                seen.add(layer.digest)
                out.append(layer)
        return out


@dataclass(frozen=True, slots=True)
class Remote:
    """A model as a registry knows it: `<base_url>/v2/<namespace>/<model>/manifests/<tag>`."""

    name: Name
    base_url: str  # scheme://host[:port]

    @property
    def repo(self) -> str:
        return f"{self.name.namespace}/{self.name.model}"

    def __str__(self) -> str:
        return f"{self.base_url}/{self.repo}:{self.name.tag}"


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address, with or without a port."""
    bare = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    if bare.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False


def _split_registry(registry: str) -> tuple[str | None, str]:
    """FREETOKEN_REGISTRY as (scheme or None, host); empty means Ollama's registry."""
    value = registry.strip().rstrip("/")
    if not value:
        return None, DEFAULT_HOST
    if "://" in value:
        scheme, host = value.split("://", 1)
        if scheme not in ("http", "https"):
            raise InvalidName(f"FREETOKEN_REGISTRY={registry!r}: unknown scheme {scheme!r}")
        return scheme, host
    return None, value


def locate(text: str, registry: str = "", insecure: bool = False) -> tuple[Name, Remote]:
    """(name in the local store, where it lives remotely) for a pull or push of `text`.

    A name without a host is kept in the store under Ollama's default host, so `run demo`
    finds what `pull demo` fetched, and is fetched from FREETOKEN_REGISTRY when that is set.
    Plain http is used only when the name or FREETOKEN_REGISTRY says `http://`, when
    `insecure` is set (as Ollama's --insecure), or when the host is a loopback address;
    every other registry is spoken to over https.
    """
    local = Name.parse(text)
    if local.digest:
        raise InvalidName(
            f"invalid model name {text!r}: pulling or pushing by digest is not supported"
        )
    reg_scheme, reg_host = _split_registry(registry)
    explicit = text.strip().split("://", 1)[0] if "://" in text else None
    remote = Name.parse(text, default_host=reg_host)
    scheme = explicit or (reg_scheme if remote.host == reg_host else None)
    if insecure:
        scheme = "http"
    elif scheme is None:
        scheme = "http" if is_loopback(remote.host) else "https"
    return local, Remote(remote, f"{scheme}://{remote.host}")
