"""Model names: `[scheme://][host/][namespace/]model[:tag][@digest]`, with Ollama's defaults.

A Name is a value type: parse once at the boundary, then pass it around. Every part is
checked against a strict grammar so that a name can never escape the store directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import PurePosixPath

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_NAMESPACE",
    "DEFAULT_TAG",
    "InvalidName",
    "Name",
    "parse_digest",
]

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"

_MODEL = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}")
_TAG = _MODEL
_NAMESPACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,79}")
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,349}")
_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")


class InvalidName(ValueError):
    """A model name or digest that does not follow the grammar."""


def parse_digest(text: str) -> str:
    """Canonical `sha256:<hex>` from `sha256:<hex>` or `sha256-<hex>`."""
    m = _DIGEST.fullmatch(text.strip())
    if not m:
        raise InvalidName(f"invalid digest format: {text!r}")
    return "sha256:" + m.group(1).lower()


@dataclass(frozen=True, slots=True)
class Name:
    host: str = DEFAULT_HOST
    namespace: str = DEFAULT_NAMESPACE
    model: str = ""
    tag: str = DEFAULT_TAG
    scheme: str = "https"
    digest: str | None = None

    @classmethod
    def parse(cls, text: str, default_host: str | None = None) -> Name:
        raw = text.strip()
        if not raw:
            raise InvalidName("invalid model name: empty")
        scheme = "https"
        if "://" in raw:
            scheme, raw = raw.split("://", 1)
            if scheme not in ("http", "https"):
                raise InvalidName(f"invalid model name {text!r}: unknown scheme {scheme!r}")
        digest = None
        if "@" in raw:
            raw, d = raw.rsplit("@", 1)
            digest = parse_digest(d)
        parts = raw.split("/")
        if len(parts) > 3 or any(p == "" for p in parts):
            raise InvalidName(f"invalid model name {text!r}")
        last = parts[-1]
        tag = DEFAULT_TAG
        if ":" in last:
            last, tag = last.rsplit(":", 1)
        host = default_host or DEFAULT_HOST
        namespace = DEFAULT_NAMESPACE
        if len(parts) == 3:
            host, namespace = parts[0], parts[1]
        elif len(parts) == 2:
            namespace = parts[0]
        name = cls(
            host=host, namespace=namespace, model=last, tag=tag, scheme=scheme, digest=digest
        )
        name.validate(text)
        return name

    def validate(self, text: str | None = None) -> None:
        shown = text if text is not None else str(self)
        checks = (
            (_HOST, self.host),
            (_NAMESPACE, self.namespace),
            (_MODEL, self.model),
            (_TAG, self.tag),
        )
        for pattern, part in checks:
            # ".." alone would be a legal model or tag by the grammar but is a path escape.
            if not pattern.fullmatch(part) or part in (".", ".."):
                raise InvalidName(f"invalid model name {shown!r}")

    def with_tag(self, tag: str) -> Name:
        return replace(self, tag=tag)

    @property
    def display(self) -> str:
        """The shortest form: `model:tag`, `ns/model:tag` or `host/ns/model:tag`."""
        if self.host.lower() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    @property
    def manifest_path(self) -> PurePosixPath:
        """Path of the manifest below `<store>/manifests/`."""
        return PurePosixPath(self.host, self.namespace, self.model, self.tag)

    @property
    def key(self) -> tuple[str, str, str, str]:
        """Case-insensitive identity, as Ollama matches names."""
        return (self.host.lower(), self.namespace.lower(), self.model.lower(), self.tag.lower())

    def __str__(self) -> str:
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
