"""Pulling a model from a registry into the store, with Ollama's progress objects.

    {"status": "pulling manifest"}
    {"status": "pulling <12 hex>", "digest": ..., "total": N, "completed": M}   per blob, repeated
    {"status": "verifying sha256 digest"}
    ({"status": "converting model", ...} and layer statuses, for a GGUF layer)
    {"status": "writing manifest"}
    {"status": "success"}

Blobs come through the process's shared `Transfers` (one download per digest, resumable
parts, verified before they enter the store). The manifest is written last, so the model
is listed only once every blob it names is in the store; until then the blobs are pinned
against a concurrent delete.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from freetoken import config
from freetoken.pull.client import RegistryClient, RegistryError
from freetoken.pull.downloads import Download, Transfers, os_error, shared_transfers
from freetoken.pull.parts import TransferOptions
from freetoken.pull.wire import Remote, WireLayer, WireManifest, locate
from freetoken.store import manifest as mf
from freetoken.store.create import CreateError, convert_into_store
from freetoken.store.models import ModelNotFound, Store
from freetoken.store.names import Name

__all__ = ["PullStats", "pull", "pull_model"]

_POLL_S = 0.1
Progress = dict[str, Any]


@dataclass
class PullStats:
    """What a pull moved, for `freetoken bench pull` and the like."""

    name: str = ""
    total_bytes: int = 0  # wire bytes of every blob of the model
    fetched_bytes: int = 0  # bytes this pull's downloads took from the network
    # File bytes they read back from disk to hash: a plain blob's, but not the frames of a
    # framed one (hashed as they are decoded), nor what an earlier pull verified.
    reread_bytes: int = 0
    cached_bytes: int = 0  # wire bytes of blobs already in the store
    seconds: float = 0.0
    events: list[Progress] = field(default_factory=list, repr=False)

    @property
    def throughput(self) -> float:
        """Bytes fetched per second over the whole pull (verification and writing included)."""
        return self.fetched_bytes / self.seconds if self.seconds > 0 else 0.0


def _event(layer: WireLayer, completed: int) -> Progress:
    return {
        "status": f"pulling {layer.digest[7:19]}",
        "digest": layer.digest,
        "total": layer.size,
        "completed": completed,
    }


def pull(
    store: Store,
    name: str,
    insecure: bool = False,
    *,
    cfg: Any = None,
    transfers: Transfers | None = None,
    transport: httpx.BaseTransport | None = None,
    stats: PullStats | None = None,
) -> Iterator[Progress]:
    """Pulls `name` into `store`, yielding progress; raises RegistryError (with an HTTP status),
    InvalidName. `cfg` defaults to this process's settings; `transfers` to the shared hub."""
    cfg = cfg or config.current()
    local, remote = locate(name, cfg.registry, insecure)
    hub = transfers or shared_transfers(TransferOptions.from_config(cfg))
    client = hub.client(remote.base_url, cfg.registry_token, transport, cfg.key)
    stats = stats if stats is not None else PullStats()
    stats.name = local.display
    # `registry` says where the model comes from (the CLI shows it); clients ignore it
    yield {"status": "pulling manifest", "registry": remote.base_url}
    wire = _fetch_manifest(client, remote)
    blobs = wire.blobs()
    with store.pin({b.local.digest for b in blobs}):
        fetched = yield from _fetch_blobs(store, hub, client, remote, blobs, stats)
        yield {"status": "verifying sha256 digest"}
        manifest = _local_manifest(wire)
        if any(x.media_type == mf.GGUF for x in wire.layers):
            manifest = yield from _converted(store, wire)
        yield {"status": "writing manifest"}
        old = _digests_of(store, local)
        try:
            store.write_manifest(local, manifest)
        except OSError as e:
            raise os_error(e, f"the manifest of {local.display}") from None
    # what this pull fetched and its manifest does not keep: a converted GGUF and its config
    store.collect(fetched - manifest.digests())
    if not cfg.noprune and old - manifest.digests():
        # As Ollama: a new version of a model frees the layers only the old one used.
        yield {"status": "removing unused layers"}
        store.collect(old - manifest.digests())
    yield {"status": "success"}


def pull_model(
    store: Store,
    name: str,
    insecure: bool = False,
    progress: Callable[[Progress], None] | None = None,
    **kw: Any,
) -> PullStats:
    """Runs a pull to its end (calling `progress` with each object); returns what it moved.

    The clean entry point for benchmarks: time it, read `fetched_bytes` and `throughput`.
    """
    stats = PullStats()
    start = time.perf_counter()
    for event in pull(store, name, insecure, stats=stats, **kw):
        if progress is not None:
            progress(event)
    stats.seconds = time.perf_counter() - start
    return stats


def _fetch_manifest(client: RegistryClient, remote: Remote) -> WireManifest:
    data = client.manifest(remote.repo, remote.name.tag)
    try:
        return WireManifest.from_bytes(data)
    except mf.ManifestError as e:
        raise RegistryError(
            f"registry {remote.base_url} sent a bad manifest for {remote}: {e}", 502
        ) from None


def _fetch_blobs(
    store: Store,
    hub: Transfers,
    client: RegistryClient,
    remote: Remote,
    blobs: list[WireLayer],
    stats: PullStats,
) -> Iterator[Progress]:
    """Fetches every blob the store lacks, reporting each blob's bytes as they arrive;
    returns the store digests it fetched."""
    downloads: dict[str, Download] = {}
    reported: dict[int, int] = {}
    try:
        for layer in blobs:
            stats.total_bytes += layer.size
            if store.blobs.has(layer.local.digest):
                stats.cached_bytes += layer.size
                yield _event(layer, layer.size)
            else:
                downloads[layer.digest] = d = hub.acquire(store.blobs, layer, client, remote.repo)
                reported[id(d)] = d.completed
                yield _event(layer, reported[id(d)])
        yield from _watch(hub, list(downloads.values()), reported)
        return {d.layer.local.digest for d in downloads.values()}
    finally:
        for d in downloads.values():
            stats.fetched_bytes += d.received
            stats.reread_bytes += d.reread
            hub.release(d)


def _watch(
    hub: Transfers, downloads: list[Download], reported: dict[int, int]
) -> Iterator[Progress]:
    """Reports each download's bytes as they change (`reported`: what was last said)."""
    while True:
        # Taken before the byte counts, so the last report of each blob is its whole size.
        running = [d for d in downloads if not d.published]
        for d in downloads:
            if d.error is not None:
                raise d.error
            completed = d.completed
            if completed != reported[id(d)]:
                reported[id(d)] = completed
                yield _event(d.layer, completed)
        if not running:
            return
        # `done` is set after `published` and `error`, so it is read first.
        stuck = [d for d in running if d.done.is_set() and not d.published and d.error is None]
        if stuck:  # stopped without publishing or failing: only a bug does this
            raise RegistryError(f"download of {stuck[0].layer.digest} stopped unfinished")
        hub.wait(_POLL_S)


def _local_manifest(wire: WireManifest) -> mf.Manifest:
    """The store's manifest: the same layers, with files named by their uncompressed blobs."""
    return mf.Manifest(wire.config.local, tuple(layer.local for layer in wire.layers))


def _converted(store: Store, wire: WireManifest) -> Iterator[Progress]:
    """Converts the GGUF layer to FTW; returns the manifest with FTW files in its place."""
    ggufs = [x for x in wire.layers if x.media_type == mf.GGUF]
    if len(ggufs) > 1:
        raise RegistryError(
            "the model has more than one GGUF layer (projectors and adapters are not supported)",
            400,
        )
    try:
        layers, model_config = yield from convert_into_store(
            store, {"model.gguf": store.blobs.path(ggufs[0].digest)}
        )
    except CreateError as e:
        raise RegistryError(str(e)) from None
    # The pulled layers that stay: template, params, system, messages, licenses, and any
    # file the conversion did not produce itself.
    names = {x.name for x in layers}
    kept = [
        x.local
        for x in wire.layers
        if x.media_type != mf.GGUF and not (x.name is not None and x.name in names)
    ]
    config_blob, _ = store.blobs.put_stream([json.dumps(model_config).encode()])
    config_layer = mf.Layer(mf.CONFIG, config_blob, store.blobs.size(config_blob))
    return mf.Manifest(config_layer, tuple(layers + kept))


def _digests_of(store: Store, name: Name) -> set[str]:
    """The blobs of the model `name` names now, if there is one."""
    try:
        return store.resolve(name).manifest.digests()
    except ModelNotFound:
        return set()
