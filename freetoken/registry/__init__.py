"""A small registry that speaks the OCI distribution subset FreeToken pulls and pushes with.

`python -m freetoken.registry serve --root DIR` serves it; `create_app(root, token)` is the app.
"""

from freetoken.registry.app import create_app

__all__ = ["create_app"]
