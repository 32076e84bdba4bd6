"""Scanning helpers the formats share: markers split across pieces of text, the end of a
JSON value written so far, a call's JSON arguments streamed as they grow, argument values
typed by a tool's schema.

Scanners keep their place: each call reads only the text not read before, so a long
argument costs linear time however finely it streams.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = [
    "ArgumentStream",
    "Head",
    "JsonEnd",
    "MarkerScan",
    "call_event",
    "json_call",
    "parameter_schema",
    "open_object",
    "partial_suffix",
    "regex_head",
    "truncated_call",
    "typed_value",
    "without",
]

Event = dict[str, Any]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def without(text: str, markers: Iterable[str]) -> str:
    """The text with every marker removed: what is shown of a call that does not parse."""
    for m in markers:
        text = text.replace(m, "")
    return text.strip()


def call_event(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"function": {"name": name, "arguments": arguments}}


def open_object(args: Mapping[str, Any]) -> str:
    """The JSON text of the pairs written so far of arguments the limit cut: the object
    without its closing brace (what a JSON call would show at that point)."""
    return json.dumps(dict(args), ensure_ascii=False)[:-1] if args else "{"


def truncated_call(index: int, name: str, arguments: str) -> Event:
    """A call the token limit cut: its name (if written) and its arguments' JSON text as
    far as it got. Never content: the API reports it as a cut call."""
    return {"tool_call_truncated": {"index": index, "name": name, "arguments": arguments}}


def json_call(obj: Any) -> dict[str, Any] | None:
    """A call from a decoded `{"name": ..., "arguments": {...}}` object (the arguments may be
    a JSON string of an object, and Llama-style `parameters` stand for them)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return call_event(obj["name"], args) if isinstance(args, dict) else None


class JsonEnd:
    """Finds where the JSON value that starts at a body's first `{` or `[` ends. Text before
    it is skipped, and quotes count only inside the value (outside it they are plain text)."""

    def __init__(self) -> None:
        self.pos = self.depth = 0
        self.started = self.in_str = self.esc = False

    def feed(self, body: str) -> int:
        """The index just past the value in `body` (the text so far), or -1."""
        i = self.pos
        while i < len(body):
            ch = body[i]
            i += 1
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = self.depth > 0
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]" and self.depth:
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i
                    return i
        self.pos = i
        return -1


class MarkerScan:
    """Finds a close marker in a call's body, outside the JSON strings of its arguments: a
    string argument may hold the marker's text (a forced call's free string can, and so can
    code about tool calls). `json`: True, quotes count inside braces; False, the body is
    XML-like text where a quote or a brace is plain text; None, JSON if the body's first
    visible character is `{`."""

    def __init__(self, close: str, json: bool | None = True):
        self.close, self.json = close, json
        self.pos = self.depth = 0
        self.in_str = self.esc = False

    def find(self, body: str) -> int:
        """The index of the close marker in the body written so far, or -1."""
        if self.json is None:
            head = body.lstrip()
            if not head:
                return -1
            self.json = head[0] == "{"
        if not self.json:
            return body.find(self.close)
        i, n = self.pos, len(self.close)
        while i < len(body):
            ch = body[i]
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == self.close[0] and self.close.startswith(body[i : i + n]):
                if len(body) - i >= n:
                    return i
                break  # maybe the marker's start: decided by the next text
            elif ch == '"':
                self.in_str = self.depth > 0  # outside the arguments, quotes are not JSON
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth = max(self.depth - 1, 0)
            i += 1
        self.pos = i
        return -1


Head = Callable[[str], tuple[int, str] | None]


def regex_head(
    pattern: re.Pattern[str], name: Callable[[re.Match[str]], str] | None = None
) -> Head:
    """A head read by a pattern that matches a call's text up to its arguments (the name in
    group 1, or as `name` says)."""

    def head(body: str) -> tuple[int, str] | None:
        m = pattern.match(body)
        if m is None:
            return None
        return m.end(), name(m) if name is not None else m.group(1)

    return head


class ArgumentStream:
    """The raw JSON text of one call's arguments, streamed as it is generated.

    Once `head` says where the arguments object starts (and the call's name), every further
    character up to the end of the object goes out as a delta, so /v1 clients see
    arguments grow token by token; the whole call still follows, for APIs that send calls
    whole. `head(body)` is None while the call's text before its arguments is incomplete.
    """

    def __init__(self, index: int, head: Head):
        self.index, self.head = index, head
        self.started = self.off = False
        self.pos = 0
        self.end = JsonEnd()

    @property
    def done(self) -> bool:
        return self.end.depth == 0 and self.end.started

    def feed(self, body: str) -> list[Event]:
        out: list[Event] = []
        if self.off or self.done:
            return out
        if not self.started:
            found = self.head(body)
            if found is None or found[0] >= len(body):
                return out  # not decided yet
            if body[found[0]] != "{":
                self.off = True  # arguments that are not an object are only sent whole
                return out
            self.started, self.pos = True, found[0]
            self.end.pos = found[0]
            out.append({"tool_call_start": {"index": self.index, "name": found[1]}})
        at = self.end.feed(body)
        stop = at if at >= 0 else len(body)
        if stop > self.pos:
            out.append(
                {"tool_call_delta": {"index": self.index, "arguments": body[self.pos : stop]}}
            )
            self.pos = stop
        return out


def _types(schema: Any) -> set[str]:
    """The JSON types a schema allows (empty: it does not say)."""
    if not isinstance(schema, Mapping):
        return set()
    t = schema.get("type")
    found = {t} if isinstance(t, str) else {x for x in t or [] if isinstance(x, str)}
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            found |= _types(sub)
    return found


def parameter_schema(schemas: Mapping[str, Any], tool: str, name: str) -> Any:
    """The schema of one parameter of an offered tool (None: not declared)."""
    params = schemas.get(tool)
    props = params.get("properties") if isinstance(params, Mapping) else None
    return props.get(name) if isinstance(props, Mapping) else None


def typed_value(raw: str, schema: Any) -> Any:
    """A parameter written as text (the XML-like call forms): JSON where the tool's schema
    says the parameter is not a string and the text parses as JSON, else the text."""
    types = _types(schema)
    if not types or "string" in types:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw
