"""Chat templates: Jinja ones (the `chat_template` of tokenizer_config.json, or a Modelfile
TEMPLATE written in Jinja) rendered in a sandbox with the helpers HF templates expect, and
Go ones (Ollama Modelfile TEMPLATEs, see gotemplate). `render_any` tells them apart.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from freetoken.chat import gotemplate
from freetoken.chat.errors import TemplateError
from freetoken.protocol import template_level

__all__ = [
    "TemplateError",
    "capabilities",
    "is_go_template",
    "render",
    "render_any",
    "think_variables",
]

# An action that only Go writes: a field or variable, a comment, or a Go keyword first.
_GO_ACTION = re.compile(
    r"\{\{-?\s*(?:\.|\$|/\*|(?:if|range|with|end|else|template|define|block)(?![\w(]))"
)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # Key order is kept (tool schemas are ordered) and non-ASCII stays readable.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"template syntax error at line {e.lineno}: {e.message}") from None


def think_variables(think: bool | str | None) -> dict[str, Any]:
    """The Jinja variables a think setting becomes: `enable_thinking` (Qwen's, GLM's), and a
    level also as `reasoning_effort` (the name templates that take a level read)."""
    if think is None:
        return {}
    out: dict[str, Any] = {"enable_thinking": bool(think)}
    level = template_level(think)
    if level is not None:
        out["reasoning_effort"] = level
    return out


def render(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    think: bool | str | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """`variables`: what the think setting becomes (a format's own names); by default
    `think_variables(think)`."""
    tpl = _compile(source)
    kw: dict[str, Any] = dict(
        messages=messages,
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token or "",
        eos_token=eos_token or "",
    )
    kw.update(think_variables(think) if variables is None else variables)
    try:
        return tpl.render(**kw)
    except TemplateError:
        raise
    except Exception as e:  # a template bug must not take the runner down
        raise TemplateError(f"template failed: {e}") from None


@lru_cache(maxsize=64)
def is_go_template(source: str) -> bool:
    """Whether `source` is Go text/template (Ollama) rather than Jinja (Hugging Face)."""
    if _GO_ACTION.search(source):
        return True
    if "{%" in source or "{#" in source:
        return False
    try:
        # No Go-only action and no Jinja block: Go if it parses as Go (`{{ messages }}`
        # does not: Go has no function of that name).
        gotemplate.parse(source)
    except TemplateError:
        return False
    return True


def render_any(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[Any] | None = None,
    think: bool | str | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    prompt: str | None = None,
    suffix: str | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """Renders a Go or a Jinja template, whichever `source` is, for a conversation that
    awaits the assistant's answer. `prompt` and `suffix` are a generate request's (a Go
    template reads them as `.Prompt` and `.Suffix`); `variables` are the Jinja variables
    the think setting becomes (a Go template reads `.Think` and `.ThinkLevel`)."""
    if is_go_template(source):
        return gotemplate.render(
            source, messages, tools=tools, think=think, prompt=prompt, suffix=suffix
        )
    return render(
        source,
        messages,
        tools=tools,
        add_generation_prompt=True,
        think=think,
        bos_token=bos_token,
        eos_token=eos_token,
        variables=variables,
    )


def capabilities(source: str | None) -> list[str]:
    """What a template supports, by what it reads (as Ollama detects capabilities)."""
    caps = ["completion"]
    if not source:
        return caps
    if is_go_template(source):
        try:
            names = gotemplate.parse(source).names
        except TemplateError:
            return caps  # Ollama, too, grants a broken template nothing
        found = {
            "tools": "tools" in names,
            "thinking": bool(names & {"think", "thinking"}),
            "insert": "suffix" in names,
        }
    else:
        found = {
            "tools": "tools" in source,
            # a template that takes a level reads reasoning_effort
            "thinking": any(
                w in source for w in ("enable_thinking", "<think>", "reasoning_effort")
            ),
            "insert": "suffix" in source,
        }
    return caps + [name for name, present in found.items() if present]
