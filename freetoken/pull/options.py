"""How pulls and pushes use the network: streams, parts, stalls, retries and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TransferOptions"]


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """How pulls and pushes use the network; `from_config` reads the settings."""

    streams: int = 8  # ranged GETs in flight (pull), layers sent at once (push)
    # The largest part of a blob. Parts are fetched in order, so the hash follows at most
    # about `streams` parts behind the bytes that arrive.
    part_size: int = 16 << 20
    min_part_size: int = 1 << 20  # a blob is cut into parts no smaller than this
    stall_timeout: float = 20.0  # seconds without a byte before a part is tried again
    retries: int = 6  # tries of one part after the first, without progress in between
    # Seconds a part may go without a byte, over all its tries and their backoff, before
    # the pull fails: a stalled registry is reported within a minute, not after every
    # try has waited out its stall (which took 274 s).
    give_up: float = 50.0
    backoff: float = 1.0  # seconds before the first retry; doubles with each
    state_every: int = 8 << 20  # bytes between writes of a part's state file
    verified_every: int = 64 << 20  # file bytes hashed between saves of the hash state
    upload_chunk: int = 64 << 20  # bytes per PATCH of an upload
    frame_size: int = 4 << 20  # file bytes per zstd frame of a pushed file

    @classmethod
    def from_config(cls, cfg: Any) -> TransferOptions:
        return cls(streams=cfg.max_transfer_streams)
