"""`freetoken show` and the REPL's `/show`: a model's facts from a POST /api/show answer."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from freetoken.cli.display import human_number, table

__all__ = ["MISSING", "field_text", "model_rows", "render"]

# What to print when a model has no such field.
MISSING = {
    "license": "No license was specified for this model.",
    "system": "No system message was specified for this model.",
    "template": "No prompt template was specified for this model.",
    "parameters": "No parameters were specified for this model.",
    "modelfile": "No Modelfile is available for this model.",
}


def _by_suffix(info: Mapping[str, Any], arch: str | None, suffix: str) -> Any:
    # GGUF keys are prefixed by the architecture; prefer that one, else any key with the suffix.
    if arch and f"{arch}{suffix}" in info:
        return info[f"{arch}{suffix}"]
    return next((v for k, v in info.items() if k.endswith(suffix)), None)


def model_rows(resp: Mapping[str, Any]) -> list[tuple[str, str]]:
    info = resp.get("model_info") or {}
    details = resp.get("details") or {}
    arch = info.get("general.architecture") or details.get("family")
    params = details.get("parameter_size")
    if not params and isinstance(info.get("general.parameter_count"), (int, float)):
        params = human_number(info["general.parameter_count"])
    rows = [
        ("architecture", arch),
        ("parameters", params),
        ("context length", _by_suffix(info, arch, ".context_length")),
        ("embedding length", _by_suffix(info, arch, ".embedding_length")),
        ("experts", _by_suffix(info, arch, ".expert_count")),
        ("experts used", _by_suffix(info, arch, ".expert_used_count")),
        ("quantization", details.get("quantization_level")),
    ]
    return [(k, str(v)) for k, v in rows if v not in (None, "")]


def _parameter_rows(text: str) -> list[tuple[str, str]]:
    rows = []
    for line in text.splitlines():
        parts = line.split(None, 1)
        if parts:
            rows.append((parts[0], parts[1].strip() if len(parts) > 1 else ""))
    return rows


def _head(text: str, verbose: bool, n: int = 2) -> list[tuple[str, ...]]:
    lines = [line for line in text.strip().splitlines()]
    rows: list[tuple[str, ...]] = [(line,) for line in (lines if verbose else lines[:n])]
    if not verbose and len(lines) > n:
        rows.append(("...",))
    return rows


def _section(title: str, rows: Sequence[Sequence[str]]) -> str:
    body = table(rows[0], rows[1:]) if rows else ""
    return f"  {title}\n" + "".join(f"    {line}\n" for line in body.splitlines())


def _metadata_rows(info: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(k, v if isinstance(v, str) else json.dumps(v)) for k, v in sorted(info.items())]


def render(resp: Mapping[str, Any], verbose: bool = False) -> str:
    """Ollama's `show` layout: sections Model, Capabilities, Parameters, System, License."""
    sections: list[tuple[str, Sequence[Sequence[str]]]] = [("Model", model_rows(resp))]
    caps = resp.get("capabilities") or []
    if caps:
        sections.append(("Capabilities", [(c,) for c in caps]))
    if resp.get("parameters"):
        sections.append(("Parameters", _parameter_rows(resp["parameters"])))
    if resp.get("system"):
        sections.append(("System", _head(resp["system"], verbose)))
    if resp.get("license"):
        sections.append(("License", _head(resp["license"], verbose)))
    if verbose and resp.get("model_info"):
        sections.append(("Metadata", _metadata_rows(resp["model_info"])))
    if verbose and resp.get("tensors"):
        sections.append(
            (
                "Tensors",
                [
                    (t.get("name", ""), t.get("type", ""), str(t.get("shape", "")))
                    for t in resp["tensors"]
                ],
            )
        )
    return "\n".join(_section(title, rows) for title, rows in sections if rows) + "\n"


def field_text(resp: Mapping[str, Any], name: str) -> str:
    """One raw field (`license`, `modelfile`, ...) or the note that the model has none."""
    value = resp.get(name)
    if isinstance(value, list):
        value = "\n".join(map(str, value))
    if not value:
        return MISSING[name] + "\n"
    return value if value.endswith("\n") else value + "\n"
