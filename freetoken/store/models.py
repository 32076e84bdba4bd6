"""The local model store: listing, name resolution, copy, delete and what /api/show reports.

`Store(root)` owns `<root>/manifests` and `<root>/blobs`. Everything here is torch-free and
synchronous; the server calls it from a thread when it touches many bytes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from freetoken import models as archs
from freetoken.chat.template import capabilities as template_capabilities
from freetoken.store import convert, modelfile
from freetoken.store import manifest as mf
from freetoken.store.blobs import BlobStore
from freetoken.store.create import FTW_INDEX, CreatePlan, CreateSpec, plan_create
from freetoken.store.names import InvalidName, Name

__all__ = ["ModelNotFound", "ModelView", "Store", "format_parameters", "rfc3339"]

log = logging.getLogger(__name__)

# How long a blob a client uploaded (or found present) is kept for the create that names it.
# Long enough for the rest of a large model's upload over a slow link; a claim no create
# takes up only keeps a blob until the next start-up prune.
CLAIM_S = 6 * 3600.0


class ModelNotFound(LookupError):
    """No complete model by that name is in the store."""

    def __init__(self, name: str):
        super().__init__(f"model '{name}' not found")
        self.name = name


def rfc3339(ts: float) -> str:
    """Local time with its UTC offset; clients parse it as an aware datetime."""
    return datetime.fromtimestamp(ts).astimezone().isoformat()


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def format_parameters(params: dict[str, Any]) -> str:
    """Ollama's `parameters` text: the key padded to 30 columns, one line per value."""
    lines = []
    for key in sorted(params):
        values = params[key] if isinstance(params[key], list) else [params[key]]
        lines += [f"{key:<30} {_format_value(v)}" for v in values]
    return "\n".join(lines)


@dataclass(frozen=True)
class ModelView:
    """A complete model as its manifest and small layers describe it."""

    name: Name
    manifest: mf.Manifest
    digest: str  # sha256 hex of the manifest file
    modified_at: float
    info: dict[str, Any]  # the config blob
    template: str | None = None
    system: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    licenses: list[str] = field(default_factory=list)

    @property
    def display(self) -> str:
        return self.name.display

    @property
    def files(self) -> dict[str, str]:
        """Relative file name -> digest, for the model directory's files."""
        out = {layer.name: layer.digest for layer in self.manifest.by_type(mf.FILE) if layer.name}
        for layer in self.manifest.by_type(mf.GGUF):
            out["model.gguf"] = layer.digest
        return out

    @property
    def details(self) -> dict[str, Any]:
        info = self.info
        family = info.get("model_family", "")
        return {
            "parent_model": info.get("parent_model", ""),
            "format": info.get("model_format", ""),
            "family": family,
            "families": info.get("model_families") or ([family] if family else None),
            "parameter_size": info.get("model_type", ""),
            "quantization_level": info.get("file_type", ""),
        }


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.manifests = self.root / "manifests"
        self.blobs = BlobStore(self.root / "blobs")
        self._json_cache: dict[str, Any] = {}
        # Create, copy and delete change manifests; one writer at a time keeps delete's
        # reference count consistent with a create that is about to reference a blob.
        self.write_lock = threading.RLock()
        # Blobs a pull or create in progress holds but no manifest names yet.
        self._pins: Counter[str] = Counter()
        # Blobs clients uploaded or asked about for a create still to come: digest -> the
        # expiry of each claim (monotonic clock).
        self._claims: dict[str, list[float]] = {}

    @classmethod
    def from_config(cls, cfg: Any = None) -> Store:
        from freetoken import config

        return cls((cfg or config.current()).models)

    # -- names ---------------------------------------------------------------------------

    def _walk(self) -> Iterator[tuple[Name, Path]]:
        if not self.manifests.is_dir():
            return
        for path in sorted(self.manifests.glob("*/*/*/*")):
            host, ns, model, tag = path.relative_to(self.manifests).parts
            if not path.is_file() or tag.startswith("."):
                continue
            name = Name(host=host, namespace=ns, model=model, tag=tag)
            try:
                name.validate()
            except InvalidName:
                continue
            yield name, path

    def _find(self, name: Name) -> tuple[Name, Path] | None:
        exact = self.manifests / name.manifest_path
        if exact.is_file():
            return name, exact
        return next(((n, p) for n, p in self._walk() if n.key == name.key), None)

    def _view(self, name: Name, path: Path) -> ModelView | None:
        try:
            manifest, digest = mf.read(path)
            if not all(self.blobs.has(d) for d in manifest.digests()):
                return None  # half-written or damaged: not a model yet
            return self._build_view(name, path, manifest, digest)
        except (OSError, ValueError) as e:
            log.warning("skipping manifest %s: %s", path, e)
            return None

    def _build_view(self, name: Name, path: Path, manifest: mf.Manifest, digest: str) -> ModelView:
        def text(media_type: str) -> str | None:
            layers = manifest.by_type(media_type)
            return self.blobs.read_bytes(layers[-1].digest).decode() if layers else None

        params = text(mf.PARAMS)
        messages = text(mf.MESSAGES)
        return ModelView(
            name=name,
            manifest=manifest,
            digest=digest,
            modified_at=path.stat().st_mtime,
            info=self.read_json(manifest.config.digest),
            template=text(mf.TEMPLATE),
            system=text(mf.SYSTEM),
            params=json.loads(params) if params else {},
            messages=json.loads(messages) if messages else [],
            licenses=[
                self.blobs.read_bytes(x.digest).decode() for x in manifest.by_type(mf.LICENSE)
            ],
        )

    def resolve(self, name: str | Name) -> ModelView:
        """A model by name, matched case-insensitively; `name` defaults to the `latest` tag."""
        text = name if isinstance(name, str) else name.display
        parsed = Name.parse(name) if isinstance(name, str) else name
        found = self._find(parsed)
        view = self._view(*found) if found else None
        if view is None:
            raise ModelNotFound(text)
        return view

    def list_models(self) -> list[dict[str, Any]]:
        """/api/tags entries, newest first."""
        views = [v for n, p in self._walk() if (v := self._view(n, p)) is not None]
        views.sort(key=lambda v: v.modified_at, reverse=True)
        return [
            {
                "name": v.display,
                "model": v.display,
                "modified_at": rfc3339(v.modified_at),
                "size": v.manifest.size,
                "digest": v.digest,
                "details": v.details,
            }
            for v in views
        ]

    # -- contents ------------------------------------------------------------------------

    def read_json(self, digest: str) -> Any:
        """A JSON blob, cached by digest (blobs never change)."""
        if digest not in self._json_cache:
            self._json_cache[digest] = json.loads(self.blobs.read_bytes(digest))
        return self._json_cache[digest]

    def file_json(self, view: ModelView, name: str) -> dict[str, Any]:
        digest = view.files.get(name)
        if digest is None:
            return {}
        data = self.read_json(digest)
        return data if isinstance(data, dict) else {}

    def chat_template(self, view: ModelView) -> str | None:
        """The template the runner renders with: the TEMPLATE layer, else the tokenizer's."""
        if view.template is not None:
            return view.template
        tmpl = self.file_json(view, "tokenizer_config.json").get("chat_template")
        if isinstance(tmpl, list):  # named templates
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        if tmpl is None and "chat_template.jinja" in view.files:
            tmpl = self.blobs.read_bytes(view.files["chat_template.jinja"]).decode()
        return tmpl if isinstance(tmpl, str) else None

    def capabilities(self, view: ModelView) -> list[str]:
        # The runner judges requests by the same function, so show and chat agree.
        return template_capabilities(self.chat_template(view))

    def model_info(self, view: ModelView) -> dict[str, Any]:
        config = self.file_json(view, "config.json")
        try:
            # the converted model's index holds its model file's description and its tensors
            return archs.model_info(config, self.file_json(view, FTW_INDEX)) if config else {}
        except (archs.UnsupportedModel, KeyError, TypeError, ValueError) as e:
            log.warning("%s: no model_info: %s", view.display, e)
            return {}

    def context_length(self, view: ModelView) -> int | None:
        """The model's trained context window, if config.json says."""
        n = self.file_json(view, "config.json").get("max_position_embeddings")
        return int(n) if isinstance(n, int) and n > 0 else None

    def modelfile(self, view: ModelView) -> str:
        m = modelfile.Modelfile(
            from_=view.display,
            parameters=dict(view.params),
            template=view.template,
            system=view.system,
            license=list(view.licenses),
            messages=list(view.messages),
        )
        return modelfile.render(m, header='Modelfile generated by "freetoken show"')

    def show(self, view: ModelView) -> dict[str, Any]:
        """The /api/show body (model_info is always present, possibly empty)."""
        out: dict[str, Any] = {
            "license": "\n".join(view.licenses),
            "modelfile": self.modelfile(view),
            "parameters": format_parameters(view.params),
            "template": self.chat_template(view) or "",
            "system": view.system or "",
            "details": view.details,
            "model_info": self.model_info(view),
            "capabilities": self.capabilities(view),
            "modified_at": rfc3339(view.modified_at),
        }
        if view.messages:
            out["messages"] = view.messages
        return {k: v for k, v in out.items() if v != "" or k == "modelfile"}

    def runner_files(self, view: ModelView) -> dict[str, str]:
        """The runner spec's `files`: relative name -> blob path."""
        return {name: str(self.blobs.path(d)) for name, d in view.files.items()}

    # -- changes -------------------------------------------------------------------------

    def write_manifest(self, name: Name, manifest: mf.Manifest) -> str:
        """Publishes a manifest whose blobs are all in the store; returns its digest hex."""
        missing = [d for d in manifest.digests() if not self.blobs.has(d)]
        if missing:
            raise FileNotFoundError(f"blob {missing[0]} is not in the store")
        with self.write_lock:
            old = self._find(name)
            digest = mf.write(self.manifests / name.manifest_path, manifest)
            # Names match case-insensitively, so a differently cased old manifest is replaced.
            if old and old[1] != self.manifests / name.manifest_path:
                self._remove_manifest(old[1])
        return digest

    def copy(self, source: str, destination: str) -> None:
        view = self.resolve(source)
        self.write_manifest(Name.parse(destination), view.manifest)

    def delete(self, name: str) -> list[str]:
        """Removes a model, then the blobs no other manifest references; returns those."""
        with self.write_lock:
            view = self.resolve(name)
            found = self._find(view.name)
            assert found is not None
            self._remove_manifest(found[1])
            return self.collect(view.manifest.digests())

    def _remove_manifest(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        parent = path.parent
        while parent != self.manifests and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent

    @contextlib.contextmanager
    def pin(self, digests: Iterable[str]) -> Iterator[None]:
        """Keeps `delete`, `collect` and `prune` off these blobs while a pull or a create
        puts a model together."""
        digests = list(digests)
        with self.write_lock:
            self._pins.update(digests)
        try:
            yield
        finally:
            with self.write_lock:
                self._pins.subtract(digests)
                self._pins = +self._pins  # drops the zero counts

    def claim(self, digest: str, *, if_present: bool = False) -> bool:
        """Marks a blob as wanted by a create still to come (an upload, or a client finding it
        present; with `if_present`, only if it is in the store). True if the blob is in the
        store. `release` takes one claim back."""
        with self.write_lock:
            present = self.blobs.has(digest)
            if present or not if_present:
                self._claims.setdefault(digest, []).append(time.monotonic() + CLAIM_S)
            return present

    def release(self, digests: Iterable[str]) -> None:
        with self.write_lock:
            for digest in digests:
                claims = self._claims.get(digest)
                if claims:
                    claims.pop(0)
                if not claims:
                    self._claims.pop(digest, None)

    def _claimed(self) -> set[str]:
        now = time.monotonic()
        for digest in list(self._claims):
            self._claims[digest] = [t for t in self._claims[digest] if t > now]
            if not self._claims[digest]:
                del self._claims[digest]
        return set(self._claims)

    def collect(self, digests: Iterable[str]) -> list[str]:
        """Removes those of `digests` that no manifest names and no pull, create or upload
        in progress holds: the garbage one change left (a source converted to FTW, the
        layers of a model deleted or replaced). Returns the digests removed."""
        with self.write_lock:
            unused = set(digests) - self.referenced()
            for digest in unused:
                self.blobs.remove(digest)
        return sorted(unused)

    def referenced(self) -> set[str]:
        """Every digest a manifest names, a pull or create in progress holds, or a client
        claimed for a create still to come."""
        out: set[str] = set(self._pins) | self._claimed()
        for _, path in self._walk():
            try:
                out |= mf.read(path)[0].digests()
            except (OSError, ValueError) as e:
                log.warning("unreadable manifest %s: %s", path, e)
        return out

    def prune(self) -> list[str]:
        """Start-up clean-up: partial uploads and downloads, stray temp manifests, the work
        directories of interrupted conversions, unreferenced blobs."""
        with self.write_lock:
            removed = self.blobs.prune(self.referenced())
            if self.manifests.is_dir():
                for tmp in self.manifests.glob("*/*/*/.*"):
                    tmp.unlink(missing_ok=True)
                    removed.append(str(tmp.relative_to(self.manifests)))
            for work in self.root.glob(convert.WORK_PREFIX + "*"):
                convert.cleanup(work)
                removed.append(work.name)
        return removed

    def plan_create(self, spec: CreateSpec) -> CreatePlan:
        """Checks a create request (raises CreateError / ModelNotFound) before any byte moves."""
        return plan_create(self, spec)
