"""Creating a model: from uploaded blobs, from another model, or from files on this machine
(a directory or GGUF file named by `from`, or the files a client on this machine lists in
`local_files`, FreeToken's own field).

`plan_create` checks everything that can be checked before a byte moves (names, parameters,
the model directory's files and its architecture), so a bad request fails with a clear error
instead of a half-finished stream. `CreatePlan.run` then converts or links files into
blobs, writes the small layers and finally the manifest, yielding Ollama-style progress
objects.

One copy of each model: weights not yet in FTW are converted, and the store keeps only the
FTW. Local sources are read in place by the converter (nothing of them enters the store);
uploaded sources are dropped once converted, unless another model, pull, create or upload
holds them (`Store.collect`). FTW files on this machine are hashed in place and linked in
(`BlobStore.stage_link`), copied only from another filesystem.
"""

from __future__ import annotations

import json
import os
import platform
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freetoken import gguf_split, quant
from freetoken import models as archs
from freetoken import options as opts
from freetoken.models import hub
from freetoken.store import convert
from freetoken.store import manifest as mf
from freetoken.store.ftwcheck import FTWInvalid, check_ftw
from freetoken.store.layers import link_file, small_layer
from freetoken.store.names import InvalidName, Name, parse_digest

if TYPE_CHECKING:
    from freetoken.store.models import ModelView, Store

__all__ = [
    "CreateError",
    "CreatePlan",
    "CreateSpec",
    "FilesNotVisible",
    "LocalFile",
    "convert_into_store",
    "is_path",
    "plan_create",
]

# Files of a model directory worth keeping: configs, weights, tokenizer data, templates.
_KEEP_SUFFIXES = (".json", ".safetensors", ".jinja", ".txt", ".model", ".tiktoken")
_INDEX = "model.safetensors.index.json"
FTW_INDEX = "ftw.json"  # docs/ftw.md: the index names its `ftw-NNNNN.bin` shards
_ROLES = {"system", "user", "assistant", "tool"}
_DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class CreateError(ValueError):
    """The create request cannot produce a model; the message says why."""


class FilesNotVisible(CreateError):
    """The server cannot read a client's local files as the client sees them (another
    machine, a container's own filesystem, another user's files): the client uploads them."""


@dataclass(frozen=True)
class LocalFile:
    """A file a client on the server's machine offers in place of an upload: its path, and
    the size and modification time it sees, so a different file at that path (another
    mount namespace, a file replaced since) is not taken for it."""

    path: str
    size: int
    mtime_ns: int


@dataclass
class CreateSpec:
    """What /api/create asks for (the Modelfile is parsed on the client)."""

    name: str
    from_: str | None = None
    files: dict[str, str] | None = None
    local_files: dict[str, LocalFile] | None = None
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    license: str | list[str] | None = None
    quantize: str | None = None  # q4_K_M or q8_0: the experts quantized while converting


def is_path(text: str) -> bool:
    """A FROM value that names a directory on the server rather than a model."""
    return text.startswith(("/", "./", "../", "~")) or text in (".", "..")


def _check_parameters(params: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if key in opts.IGNORED:
            continue
        if key not in opts.OPTION_TYPES:
            raise CreateError(f"unknown parameter '{key}'")
        try:
            out[key] = opts.coerce(key, value, from_text=isinstance(value, str))
        except opts.OptionError as e:
            raise CreateError(str(e)) from None
    return out


def _check_messages(messages: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if messages is None:
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict) or str(m.get("role", "")).lower() not in _ROLES:
            raise CreateError(f"invalid message {m!r}: role must be one of {sorted(_ROLES)}")
        out.append({"role": m["role"].lower(), "content": str(m.get("content") or "")})
    return out


def _file_type(config: dict[str, Any], index: dict[str, Any] | None = None) -> str:
    """The weights' type as `show` reports it: the quantization `create --quantize` applied
    (Q4_K_M), else a GGUF's own file type where its tensors kept their types (Q4_K_M), else
    the block format holding most of the FTW's bytes (Q4_K, Q8_0, FP8_E4M3, …), else the
    checkpoint's quantization or float dtype."""
    if (index or {}).get("quantize"):
        return str(index["quantize"]).upper()
    source = (index or {}).get("source")
    if isinstance(source, dict) and source.get("file_type"):
        return str(source["file_type"])
    by_bytes: dict[str, int] = {}
    for t in (index or {}).get("tensors") or []:
        if isinstance(t, dict) and t.get("quant"):
            by_bytes[t["quant"]] = by_bytes.get(t["quant"], 0) + int(t.get("nbytes") or 0)
    if by_bytes:
        return max(by_bytes, key=by_bytes.__getitem__).upper()
    quant = config.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method"):
        return str(quant["quant_method"]).upper()
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    return _DTYPE_NAMES.get(dtype, dtype.upper())


def _model_config(
    config: dict[str, Any], where: str, index: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The manifest's config blob for an HF directory with this config.json; with its FTW
    index the parameter count is the tensors' (exact), else estimated from the config."""
    try:
        arch = archs.arch_for(config)
        count = archs.model_info(config, index)["general.parameter_count"]
        size = archs.format_parameter_size(count)
    except archs.UnsupportedModel as e:
        raise CreateError(f"{where}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CreateError(f"{where}: config.json is missing or has a bad {e}") from None
    return {
        "model_format": "safetensors",
        "model_family": arch.family,
        "model_families": [arch.family],
        "model_type": size,
        "file_type": _file_type(config, index),
        "architecture": _GOARCH.get(platform.machine().lower(), platform.machine().lower()),
        "os": platform.system().lower(),
    }


def _keep(name: str) -> bool:
    if name.startswith("."):
        return False
    return name.endswith(_KEEP_SUFFIXES) or (name.startswith("ftw-") and name.endswith(".bin"))


def _shards(read_json: Any, index: str) -> set[str]:
    data = read_json(index)
    if not isinstance(data, dict):
        return set()
    if index == FTW_INDEX:
        return {s.get("file") for s in data.get("shards") or [] if isinstance(s, dict)}
    return set((data.get("weight_map") or {}).values())


def _check_files(
    names: set[str], read_json: Any, where: str, size_of: Callable[[str], int | None]
) -> dict[str, Any]:
    """Checks a model directory's file set; returns its manifest config blob. An FTW
    model's index and shards are checked whole (`size_of`: a file's size, None if absent).

    A single GGUF file (or every part of a split one) is accepted as it is: what it holds
    is known once it is converted.
    """
    ggufs = [n for n in names if n.endswith(".gguf")]
    if len(ggufs) > 1 and not gguf_split.first_of(ggufs):
        raise CreateError(f"{where}: more than one GGUF file ({', '.join(sorted(ggufs))})")
    if ggufs:
        return {}
    if "config.json" not in names:
        raise CreateError(f"{where} has no config.json (not a Hugging Face model directory)")
    if not any(n.endswith(".safetensors") for n in names) and FTW_INDEX not in names:
        raise CreateError(f"{where} has no weights (*.safetensors or {FTW_INDEX})")
    if "tokenizer.json" not in names:
        raise CreateError(f"{where} has no tokenizer.json")
    for index in (_INDEX, FTW_INDEX):
        missing = sorted(_shards(read_json, index) - names) if index in names else []
        if missing:
            raise CreateError(f"{where}: {index} names {missing[0]}, which is missing")
    config = read_json("config.json")
    if not isinstance(config, dict):
        raise CreateError(f"{where}: config.json is not a JSON object")
    if hub.QUANT_FILE in names:
        config = hub.with_quant_file(config, read_json(hub.QUANT_FILE))
    index = read_json(FTW_INDEX) if FTW_INDEX in names else None
    if index is not None:
        try:
            check_ftw(index, lambda name: size_of(name) if name in names else None)
        except FTWInvalid as e:
            raise CreateError(f"{where}: {FTW_INDEX}: {e}") from None
    out = _model_config(config, where, index if isinstance(index, dict) else None)
    if FTW_INDEX in names:
        out["model_format"] = "ftw"
    return out


@dataclass
class CreatePlan:
    """A checked create request; `run` does the work."""

    store: Store
    name: Name
    model_config: dict[str, Any]
    base_layers: list[mf.Layer] = field(default_factory=list)
    local: dict[str, Path] = field(default_factory=dict)  # name -> a file on this machine
    upload_files: dict[str, str] = field(default_factory=dict)  # name -> digest, already stored
    extra: dict[str, Any] = field(default_factory=dict)  # the small layers: media type -> value
    quantize: str | None = None

    @property
    def needs_conversion(self) -> bool:
        """Weights not yet in FTW are converted, so the store holds what the runner reads."""
        names = set(self.upload_files) | set(self.local)
        gguf = any(n.endswith(".gguf") for n in names)
        return bool(names) and (gguf or FTW_INDEX not in names or self.quantize is not None)

    def run(self) -> Iterator[dict[str, Any]]:
        """Builds the model; uploaded blobs the manifest does not keep are collected after it
        is written. Pins keep other changes off every blob this create reads meanwhile."""
        uploads = list(self.upload_files.values())  # one claim each, as the client made them
        held = set(uploads) | {x.digest for x in self.base_layers}
        try:
            with self.store.pin(held):
                manifest = yield from self._build()
        finally:
            self.store.release(uploads)
        self.store.collect(set(uploads) - manifest.digests())
        yield {"status": "success"}

    def _build(self) -> Iterator[dict[str, Any]]:
        blobs = self.store.blobs
        blobs.ensure()
        layers = list(self.base_layers)
        if self.needs_conversion:
            layers += yield from self._converted()
        for name, digest in sorted(self.upload_files.items()):
            yield {"status": f"using existing layer {digest}"}
            layers.append(mf.Layer(mf.FILE, digest, blobs.size(digest), name))
        for name, path in sorted(self.local.items()):
            layer = yield from link_file(blobs, path, name)
            layers.append(layer)
        for media_type, value in self.extra.items():
            for text in value if media_type == mf.LICENSE else [value]:
                layer = yield from small_layer(blobs, media_type, text)
                layers.append(layer)
        config = yield from small_layer(blobs, mf.CONFIG, json.dumps(self.model_config))
        yield {"status": "writing manifest"}
        manifest = mf.Manifest(config, tuple(layers))
        self.store.write_manifest(self.name, manifest)
        return manifest

    def _converted(self) -> Iterator[dict[str, Any]]:
        """Converts the source to FTW and adds its files as layers (the source is not kept)."""
        blobs = self.store.blobs
        source = {n: blobs.path(d) for n, d in self.upload_files.items()} | self.local
        label = "the uploaded files" if self.upload_files and len(source) > 1 else ""
        layers, self.model_config = yield from convert_into_store(
            self.store, source, label, self.quantize
        )
        self.upload_files, self.local = {}, {}
        return layers


def convert_into_store(
    store: Store, source: dict[str, Path], label: str = "", quantize: str | None = None
) -> Iterator[dict[str, Any]]:
    """Converts files named like a model's (name -> path: a Hugging Face directory's files,
    one GGUF file, or an FTW model's to quantize it) to FTW, its experts quantized where
    asked, and moves the FTW files into the blobs; returns (layers, manifest config blob).
    Messages name the source as `label` (default: its one file's name, or its files'
    folder).

    Create and pull (of a GGUF layer) both use it. Raises CreateError.
    """
    paths = list(source.values())
    label = label or (paths[0].name if len(paths) == 1 else paths[0].parent.name)
    blobs = store.blobs
    work = convert.work_dir(store.root)
    try:
        src = convert.source_of_files(source, work)
        out = work / "ftw"
        try:
            # the converter hashes what it writes, so nothing is read back to name the blobs
            digests = yield from convert.run_converter(src, out, label, quantize)
        except convert.ConversionFailed as e:
            raise CreateError(str(e)) from None
        config = json.loads((out / "config.json").read_text())
        index = json.loads((out / FTW_INDEX).read_text())
        model_config = {**_model_config(config, label, index), "model_format": "ftw"}
        layers = []
        for f in sorted(out.iterdir()):
            digest, size, created = blobs.adopt(f, digests.get(f.name))
            yield {"status": f"{'creating new' if created else 'using existing'} layer {digest}"}
            layers.append(mf.Layer(mf.FILE, digest, size, f.name))
    finally:
        convert.cleanup(work)
    return layers, model_config


def _extra_layers(spec: CreateSpec, base: ModelView | None) -> dict[str, Any]:
    """The small layers this request sets; parameters merge over the base model's."""
    out: dict[str, Any] = {}
    if spec.template is not None:
        out[mf.TEMPLATE] = spec.template
    if spec.system is not None:
        out[mf.SYSTEM] = spec.system
    params = _check_parameters(spec.parameters)
    if params:
        out[mf.PARAMS] = json.dumps({**(base.params if base else {}), **params})
    messages = _check_messages(spec.messages)
    if messages is not None:
        out[mf.MESSAGES] = json.dumps(messages)
    if spec.license is not None:
        out[mf.LICENSE] = [spec.license] if isinstance(spec.license, str) else list(spec.license)
    return out


def _check_name(name: str) -> None:
    if not mf.safe_file_name(name) or name.startswith("~"):
        raise CreateError(f"invalid file name {name!r}: paths must be relative")


def _from_files(store: Store, plan: CreatePlan, files: dict[str, str]) -> None:
    where = "the uploaded files"
    checked: dict[str, str] = {}
    for name, digest in files.items():
        _check_name(name)
        try:
            digest = parse_digest(str(digest))
        except InvalidName as e:
            raise CreateError(str(e)) from None
        if not store.blobs.has(digest):
            raise CreateError(f'blob "{digest}" not found (upload it to /api/blobs first)')
        checked[name] = digest

    def read(name: str) -> Any:
        try:
            return store.read_json(checked[name])
        except (OSError, ValueError) as e:
            raise CreateError(f"{where}: cannot read {name}: {e}") from None

    size_of = lambda name: store.blobs.size(checked[name])  # noqa: E731
    plan.model_config = _check_files(set(checked), read, where, size_of)
    plan.upload_files = checked


def _visible(name: str, f: LocalFile) -> Path:
    """The client's file, if this process sees the same one where the client does."""
    path = Path(f.path)
    if not path.is_absolute():
        raise CreateError(f"local file {name!r}: {f.path!r} is not an absolute path")
    try:
        st = path.stat()
    except OSError as e:
        raise FilesNotVisible(f"the server cannot see {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or (st.st_size, st.st_mtime_ns) != (f.size, f.mtime_ns):
        raise FilesNotVisible(f"the server sees another file at {path} than the client")
    if not os.access(path, os.R_OK):
        raise FilesNotVisible(f"the server may not read {path}")
    return path


def _from_local(plan: CreatePlan, files: dict[str, LocalFile]) -> None:
    """Files of the client's machine that this process can read in place: no upload."""
    checked: dict[str, Path] = {}
    for name, f in files.items():
        _check_name(name)
        checked[name] = _visible(name, f)
    where = "the local files"

    def read(name: str) -> Any:
        try:
            return json.loads(checked[name].read_text())
        except (OSError, ValueError) as e:
            raise CreateError(f"{where}: cannot read {name}: {e}") from None

    size_of = lambda name: checked[name].stat().st_size  # noqa: E731
    plan.model_config = _check_files(set(checked), read, where, size_of)
    plan.local = checked


def _from_directory(plan: CreatePlan, text: str) -> None:
    path = Path(text).expanduser().absolute()  # links to its files are made elsewhere
    if path.is_file() and path.suffix == ".gguf":
        try:
            plan.local = {p.name: p for p in gguf_split.parts(path)}
        except gguf_split.MissingParts as e:
            raise CreateError(str(e)) from None
        return
    if not path.exists():
        raise CreateError(f"directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise CreateError(f"{str(path)!r} is not a directory (FROM a path needs a model directory)")
    where = f"directory {str(path)!r}"
    names = sorted(p.name for p in path.iterdir() if p.is_file() and _keep(p.name))

    def read(name: str) -> Any:
        try:
            return json.loads((path / name).read_text())
        except (OSError, ValueError) as e:
            raise CreateError(f"{where}: cannot read {name}: {e}") from None

    ggufs = _gguf_names(path)
    size_of = lambda name: (path / name).stat().st_size  # noqa: E731
    plan.model_config = _check_files(set(names) | ggufs, read, where, size_of)
    split = gguf_split.first_of(ggufs)
    kept = sorted(ggufs) if split else [next(iter(ggufs))] if ggufs else names
    plan.local = {name: path / name for name in kept}


def _gguf_names(path: Path) -> set[str]:
    return {p.name for p in path.glob("*.gguf")}


def plan_create(store: Store, spec: CreateSpec) -> CreatePlan:
    name = Name.parse(spec.name)
    plan = CreatePlan(store=store, name=name, model_config={})
    base = None
    if spec.local_files:
        _from_local(plan, spec.local_files)
    elif spec.files:
        _from_files(store, plan, spec.files)
    elif spec.from_ and is_path(spec.from_):
        _from_directory(plan, spec.from_)
    elif spec.from_:
        base = store.resolve(spec.from_)
        plan.model_config = {**base.info, "parent_model": base.display}
    else:
        raise CreateError("neither 'from' or 'files' was specified")
    plan.extra = _extra_layers(spec, base)
    if spec.quantize:
        plan.quantize = _quantize_type(spec.quantize)
        if base is not None:  # its files are converted again, quantized
            plan.upload_files = dict(base.files)
    if base is not None:
        replaced = set(plan.extra) | ({mf.FILE, mf.GGUF} if plan.quantize else set())
        plan.base_layers = [x for x in base.manifest.layers if x.media_type not in replaced]
    return plan


def _quantize_type(text: str) -> str:
    try:
        return quant.quantize_type(text)
    except quant.QuantError as e:
        raise CreateError(str(e)) from None
