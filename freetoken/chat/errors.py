"""The one error every template path raises, so callers catch a single type."""

from __future__ import annotations

__all__ = ["TemplateError"]


class TemplateError(ValueError):
    """The template cannot be compiled or raised while rendering."""
