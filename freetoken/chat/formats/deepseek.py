"""DeepSeek-V3/R1 (and V2, V3.1): thinking between `<think>` and `</think>`; tool calls in
DeepSeek's special tokens,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>CALL<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>

where V3 and R1 write a CALL as `function<｜tool▁sep｜>NAME` and the arguments in a fenced
JSON block, and V3.1 as `NAME<｜tool▁sep｜>ARGUMENTS`. Both are read; a forced call is
written as the model's template writes calls, and so is a call's grammar (one section of
any number of calls). V3.1's template reads `thinking`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from freetoken.chat.formats.markup import DelimitedFormat
from freetoken.chat.formats.scan import call_event
from freetoken.chat.grammar import Lark, lit
from freetoken.chat.structured import named_calls

__all__ = ["DeepSeekFormat"]

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# after the separator, V3's form: the name, then a fenced block
_FENCED = re.compile(r"\s*([^\n`{]+?)[ \t]*\n```(?:json)?[ \t]*\n")
_FENCED_CALL = re.compile(r"\s*([^\n`{]+?)\s*\n```(?:json)?\s*\n(.*?)\s*```\s*", re.S)


@dataclass(frozen=True)
class DeepSeekFormat(DelimitedFormat):
    think_open: str | None = "<think>"
    think_close: str | None = "</think>"
    call_open: str | None = CALLS_BEGIN
    fenced: bool = False  # forced calls in V3's form (the template shows it), else V3.1's

    name: ClassVar[str] = "deepseek"
    markers: ClassVar[tuple[str, ...]] = (
        CALLS_BEGIN,
        CALLS_END,
        CALL_BEGIN,
        CALL_END,
        SEP,
        "<think>",
        "</think>",
    )
    call_begin: ClassVar[str | None] = CALL_BEGIN
    call_end: ClassVar[str] = CALL_END
    call_close: ClassVar[str] = CALLS_END
    scan_json: ClassVar[bool] = True
    streams_arguments: ClassVar[bool] = True

    @classmethod
    def from_template(cls, template: str | None) -> DeepSeekFormat:
        return cls(fenced="```json" in (template or ""))

    def arguments_start(self, text: str) -> tuple[int, str] | None:
        left, sep, right = text.partition(SEP)
        rest = right.lstrip()
        if not sep or not rest:
            return None
        if rest[0] == "{":  # V3.1: the arguments follow the separator
            return len(text) - len(rest), left.strip()
        m = _FENCED.match(right)
        return (len(left) + len(sep) + m.end(), m.group(1)) if m else None

    def parse_call(self, text: str, schemas: Mapping[str, Any]) -> dict[str, Any] | None:
        left, sep, right = text.partition(SEP)
        if not sep:
            return None
        m = _FENCED_CALL.fullmatch(right)
        name, args = (m.group(1), m.group(2)) if m else (left.strip(), right)
        try:
            value = json.loads(args)
        except ValueError:
            return None
        return call_event(name, value) if name and isinstance(value, dict) else None

    def call_rules(
        self, lark: Lark, tools: list[dict[str, Any]], lenient: bool, parallel: bool
    ) -> str:
        def around(fn: str) -> tuple[str, str]:
            if self.fenced:
                head = lit(f"{CALL_BEGIN}function{SEP}{fn}\n```json\n")
                return head, f'"\\n"? {lit("```" + CALL_END)}'
            return lit(f"{CALL_BEGIN}{fn}{SEP}"), lit(CALL_END)

        call = named_calls(lark, tools, lenient, around)
        more = f'("\\n"? {call})*' if parallel else ""
        return lark.rule(f"{call} {more} {lit(CALLS_END)}")

    def template_variables(self, think: bool | str | None) -> dict[str, Any]:
        out = super().template_variables(think)
        if think is not None:
            out["thinking"] = bool(think)
        return out
