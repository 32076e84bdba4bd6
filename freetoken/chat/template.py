"""Rendering Jinja chat templates (the `chat_template` of tokenizer_config.json, or a
Modelfile TEMPLATE written in Jinja) in a sandbox, with the helpers HF templates expect.
"""

from __future__ import annotations

import datetime
import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TemplateError", "capabilities", "render"]


class TemplateError(ValueError):
    """The template cannot be compiled or raised while rendering."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # Key order is kept (tool schemas are ordered) and non-ASCII stays readable.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"template syntax error at line {e.lineno}: {e.message}") from None


def render(source: str, messages: list[dict[str, Any]], *, tools: list[dict] | None = None,
           add_generation_prompt: bool = True, think: bool | None = None,
           bos_token: str | None = None, eos_token: str | None = None) -> str:
    tpl = _compile(source)
    kw: dict[str, Any] = dict(messages=messages, tools=tools or None,
                              add_generation_prompt=add_generation_prompt,
                              bos_token=bos_token or "", eos_token=eos_token or "")
    if think is not None:
        kw["enable_thinking"] = think
    try:
        return tpl.render(**kw)
    except TemplateError:
        raise
    except Exception as e:  # a template bug must not take the runner down
        raise TemplateError(f"template failed: {e}") from None


def capabilities(source: str | None) -> list[str]:
    """What a template supports, by what it reads (as Ollama detects capabilities)."""
    caps = ["completion"]
    if not source:
        return caps
    if "tools" in source or ".Tools" in source:
        caps.append("tools")
    if "enable_thinking" in source or "<think>" in source or ".Think" in source:
        caps.append("thinking")
    if ".Suffix" in source or "suffix" in source:
        caps.append("insert")
    return caps
