"""What handlers share: the settings, the model store and the residency of loaded models."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from freetoken.server.residency import Residency
from freetoken.store import InvalidName, ModelNotFound, ModelView, Store

__all__ = ["Services", "resolve", "services"]


@dataclass
class Services:
    cfg: Any
    store: Store
    residency: Residency


def services(request: Request) -> Services:
    return request.app.state.services


async def resolve(svc: Services, name: str) -> ModelView:
    """The model a request names; an unknown or malformed name is Ollama's 404."""
    try:
        return await run_in_threadpool(svc.store.resolve, name)
    except InvalidName:
        raise ModelNotFound(name) from None
