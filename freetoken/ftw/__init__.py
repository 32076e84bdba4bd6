"""FTW, the aligned weight format (spec: docs/ftw.md): writer, reader, converters."""

FORMAT = "freetoken-ftw"
VERSION = 1
ALIGN = 4096
INDEX = "ftw.json"
DEFAULT_SHARD_LIMIT = 8 << 30


class FtwError(ValueError):
    """An FTW file is missing, truncated, corrupted or of an unknown version."""


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def bank_name(layer: int, bank: str) -> str:
    return f"{bank}#L{layer:05d}"
