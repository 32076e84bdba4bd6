"""Modelfile parsing and rendering.

Syntax (as Ollama's): `# comment` lines; `INSTRUCTION args`, instructions case-insensitive;
values may be bare, "quoted" or span lines inside triple quotes. Instructions: FROM
(required), PARAMETER key value (repeatable, e.g. several `stop`), TEMPLATE, SYSTEM,
ADAPTER, LICENSE (repeatable), MESSAGE role text, REQUIRES, RENDERER, PARSER, DRAFT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from freetoken import options as opts

__all__ = ["Modelfile", "ModelfileError", "parse", "render"]

_INSTRUCTIONS = {
    "from",
    "parameter",
    "template",
    "system",
    "adapter",
    "license",
    "message",
    "requires",
    "renderer",
    "parser",
    "draft",
}
_ROLES = {"system", "user", "assistant", "tool"}


class ModelfileError(ValueError):
    """The Modelfile text cannot be parsed."""


@dataclass
class Modelfile:
    from_: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    adapters: list[str] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    requires: str | None = None
    renderer: str | None = None
    parser: str | None = None
    draft: str | None = None


def _read_value(text: str, pos: int, line_no: int) -> tuple[str, int]:
    """Reads one value starting at `pos` (after the instruction); returns (value, new pos)."""
    if text.startswith('"""', pos):
        end = text.find('"""', pos + 3)
        if end < 0:
            raise ModelfileError(f"line {line_no}: unterminated triple-quoted string")
        return text[pos + 3 : end], end + 3
    eol = text.find("\n", pos)
    eol = len(text) if eol < 0 else eol
    line = text[pos:eol].strip()
    if len(line) >= 2 and line[0] == '"' and line[-1] == '"':
        line = line[1:-1].replace('\\"', '"')
    return line, eol


def _split_first(value: str, line_no: int, what: str) -> tuple[str, str]:
    parts = value.split(None, 1)
    if len(parts) != 2:
        raise ModelfileError(f"line {line_no}: {what} needs a name and a value")
    key, rest = parts
    rest = rest.strip()
    if rest.startswith('"""') and rest.endswith('"""') and len(rest) >= 6:
        rest = rest[3:-3]
    elif len(rest) >= 2 and rest[0] == '"' and rest[-1] == '"':
        rest = rest[1:-1]
    return key, rest


def parse(text: str) -> Modelfile:
    mf = Modelfile()
    pos, n = 0, len(text)
    while pos < n:
        line_no = text.count("\n", 0, pos) + 1
        eol = text.find("\n", pos)
        eol = n if eol < 0 else eol
        stripped = text[pos:eol].strip()
        if not stripped or stripped.startswith("#"):
            pos = eol + 1
            continue
        start = pos + (len(text[pos:eol]) - len(text[pos:eol].lstrip()))
        word_end = start
        while word_end < n and not text[word_end].isspace():
            word_end += 1
        instr = text[start:word_end].lower()
        if instr not in _INSTRUCTIONS:
            raise ModelfileError(f"line {line_no}: unknown instruction {text[start:word_end]!r}")
        vpos = word_end
        while vpos < n and text[vpos] in " \t":
            vpos += 1
        if instr in ("parameter", "message") and not text.startswith('"""', vpos):
            # key first, then a value that may itself be triple-quoted
            key_end = vpos
            while key_end < n and not text[key_end].isspace():
                key_end += 1
            key = text[vpos:key_end]
            rest_pos = key_end
            while rest_pos < n and text[rest_pos] in " \t":
                rest_pos += 1
            value, pos = _read_value(text, rest_pos, line_no)
            _apply(mf, instr, f"{key} {value}" if key else value, line_no, pair=(key, value))
        else:
            value, pos = _read_value(text, vpos, line_no)
            _apply(mf, instr, value, line_no)
        pos += 1
    if not mf.from_:
        raise ModelfileError("no FROM line")
    return mf


def _apply(
    mf: Modelfile, instr: str, value: str, line_no: int, pair: tuple[str, str] | None = None
) -> None:
    if instr == "from":
        mf.from_ = value
    elif instr == "parameter":
        key, raw = (
            pair
            if pair and pair[0] and pair[1] != ""
            else _split_first(value, line_no, "PARAMETER")
        )
        key = key.lower()
        if key not in opts.OPTION_TYPES and key not in opts.IGNORED:
            raise ModelfileError(f"line {line_no}: unknown parameter {key!r}")
        converted = opts.coerce(key, raw, from_text=True)
        if opts.OPTION_TYPES.get(key) == "list[str]":
            mf.parameters.setdefault(key, []).extend(converted)
        else:
            mf.parameters[key] = converted
    elif instr == "message":
        role, content = pair if pair and pair[0] else _split_first(value, line_no, "MESSAGE")
        role = role.lower()
        if role not in _ROLES:
            raise ModelfileError(f"line {line_no}: MESSAGE role must be one of {sorted(_ROLES)}")
        mf.messages.append({"role": role, "content": content})
    elif instr == "license":
        mf.license.append(value)
    elif instr == "adapter":
        mf.adapters.append(value)
    else:
        setattr(mf, instr, value)


def _quote(value: str) -> str:
    return f'"""{value}"""' if ("\n" in value or '"' in value) else f'"{value}"'


def render(mf: Modelfile, header: str | None = None) -> str:
    """Modelfile text that parses back to `mf` (used by `show --modelfile`)."""
    lines: list[str] = []
    if header:
        lines += [f"# {h}" if h else "#" for h in header.splitlines()] + [""]
    lines.append(f"FROM {mf.from_}")
    if mf.template is not None:
        lines.append(f"TEMPLATE {_quote(mf.template)}")
    if mf.system is not None:
        lines.append(f"SYSTEM {_quote(mf.system)}")
    for key, value in mf.parameters.items():
        values = value if isinstance(value, list) else [value]
        for v in values:
            shown = (
                json.dumps(v)
                if isinstance(v, str)
                else (str(v).lower() if isinstance(v, bool) else v)
            )
            lines.append(f"PARAMETER {key} {shown}")
    for msg in mf.messages:
        lines.append(f"MESSAGE {msg['role']} {_quote(msg['content'])}")
    for lic in mf.license:
        lines.append(f"LICENSE {_quote(lic)}")
    for name in ("requires", "renderer", "parser", "draft"):
        v = getattr(mf, name)
        if v is not None:
            lines.append(f"{name.upper()} {v}")
    return "\n".join(lines) + "\n"
