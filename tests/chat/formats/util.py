"""What every format's tests check: the same events however the output is cut into pieces,
and no marker in content or thinking."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from freetoken.chat import formats
from freetoken.chat.formats import ChatFormat, ParseOptions, Parser

Event = dict[str, Any]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}, "n": {"type": "array"}},
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def options(**kw: Any) -> ParseOptions:
    """Tools offered (with their schemas) unless told otherwise."""
    return ParseOptions(**{"tools": True, "schemas": SCHEMAS, **kw})


def merge(events: list[Event]) -> list[Event]:
    """Adjacent pieces of content, of thinking and of one call's arguments joined."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if last is not None and set(e) == set(last) and len(e) == 1:
            key = next(iter(e))
            if key in ("content", "thinking"):
                out[-1] = {key: last[key] + e[key]}
                continue
            if key == "tool_call_delta" and last[key]["index"] == e[key]["index"]:
                joined = last[key]["arguments"] + e[key]["arguments"]
                out[-1] = {key: {"index": e[key]["index"], "arguments": joined}}
                continue
        out.append(e)
    return out


def pieces(text: str, seed: int | None) -> list[str]:
    """The text whole (seed None), one character at a time (seed -1), or in random pieces."""
    if seed is None:
        return [text]
    if seed < 0:
        return list(text)
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


def run(
    make: Callable[[], Parser], text: str, seed: int | None = None, cut: bool = False
) -> list[Event]:
    parser = make()
    events: list[Event] = []
    for piece in pieces(text, seed):
        events += parser.feed(piece)
    return merge(events + parser.finish(cut))


def parse(fmt: ChatFormat, text: str, cut: bool = False, **kw: Any) -> list[Event]:
    """The events of `text`, checked to be the same in every cutting and free of markup;
    `cut`: the token limit ended the output there."""
    make = lambda: fmt.parser(options(**kw))  # noqa: E731
    whole = run(make, text, cut=cut)
    for seed in (-1, 0, 1, 2, 3):
        assert run(make, text, seed, cut) == whole, f"cut {seed} differs"
    assert_no_markup(whole)
    return whole


def assert_no_markup(events: list[Event]) -> None:
    for e in events:
        for key in ("content", "thinking"):
            for marker in formats.MARKERS:
                assert marker not in e.get(key, ""), f"{marker!r} leaked into {key}: {e}"


def calls(events: list[Event]) -> list[dict[str, Any]]:
    return [c["function"] for e in events for c in e.get("tool_calls", [])]


def streamed_arguments(events: list[Event]) -> dict[int, Any]:
    """Each call's streamed argument text, parsed."""
    text: dict[int, str] = {}
    for e in events:
        if "tool_call_delta" in e:
            d = e["tool_call_delta"]
            text[d["index"]] = text.get(d["index"], "") + d["arguments"]
    return {i: json.loads(t) for i, t in text.items()}


_BYTES = None  # grammars compiled over a vocabulary of the 256 bytes (any text is tokens)


def accepts(grammar: Any, text: str) -> bool:
    """Whether `text` is a whole sentence of the grammar."""
    from freetoken.runtime.constrain import Grammars
    from freetoken.runtime.vocab import Vocab

    global _BYTES
    if _BYTES is None:
        _BYTES = Grammars(Vocab([bytes((b,)) for b in range(256)] + [b""], 257), [256])
    m = _BYTES.matcher(grammar)
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


def forced(fmt: ChatFormat, name: str | None = None, tools: list[Any] = TOOLS) -> Any:
    """The format's grammar of an answer that calls `name` (any of the tools: None)."""
    from freetoken.chat.structured import forced_tools

    return fmt.call_grammar(forced_tools(tools, name))
