"""FTW, the aligned weight format (spec: docs/ftw.md): writer, reader, converters."""

FORMAT = "freetoken-ftw"
VERSION = 1
ALIGN = 4096
INDEX = "ftw.json"
# 2 GiB: each shard is one SHA-256 chain, hashed by one core at about a disk's speed or
# slower, so a create hashes several shards at once (ftw/sink.py); registries and pulls
# move each shard as a layer of its own, in parallel too
DEFAULT_SHARD_LIMIT = 2 << 30


class FtwError(ValueError):
    """An FTW file is missing, truncated, corrupted or of an unknown version."""


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def bank_name(layer: int, bank: str) -> str:
    return f"{bank}#L{layer:05d}"
