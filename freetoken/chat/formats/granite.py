"""Granite (granite-3.x): no thinking; tool calls after the `<|tool_call|>` marker as a JSON
list, `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`: Mistral's listed form behind
another marker (chat/formats/mistral.py reads and writes it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from freetoken.chat.formats.mistral import MistralFormat

__all__ = ["GraniteFormat"]

CALL = "<|tool_call|>"


@dataclass(frozen=True)
class GraniteFormat(MistralFormat):
    call_open: str | None = CALL
    listed: bool = True

    name: ClassVar[str] = "granite"
    markers: ClassVar[tuple[str, ...]] = (CALL,)

    @classmethod
    def from_template(cls, template: str | None) -> GraniteFormat:
        return cls()  # its calls are always a list
