"""The three ways a command fails; `main` turns each into `Error: ...` and exit status 1."""

from __future__ import annotations

__all__ = ["CommandError", "NotRunning", "ServerError"]


class CommandError(Exception):
    """Something wrong on this side: a missing Modelfile, a bad flag value."""


class NotRunning(Exception):
    def __init__(self, url: str) -> None:
        super().__init__(
            f"could not connect to the FreeToken server at {url}, is it running? "
            "Start it with 'freetoken serve'."
        )
        self.url = url


class ServerError(Exception):
    """The server answered with an error, with a status code or as a stream's error line."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
