"""The HTTP API (Ollama's routes). Imports no torch, directly or indirectly."""

from freetoken.api.app import create_app, routes

__all__ = ["create_app", "routes"]
