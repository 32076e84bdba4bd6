"""FreeToken's own endpoints for the GPU expert cache of loaded models.

GET /api/cache lists each loaded model's cache (slots, bytes, hit rate, the measured
bandwidths and the split); POST /api/cache/resize {model, size | slots} grows or shrinks one
while requests run (the runner applies it between steps).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.api.errors import APIError, handler
from freetoken.api.state import resolve, services
from freetoken.api.types import field_of, parse_json

__all__ = ["cache", "resize", "summary"]


def summary(name: str, stats: dict) -> dict:
    """A model's /api/cache entry, from its runner's stats."""
    experts = stats.get("experts") or {}
    return {
        "name": name,
        "policy": experts.get("policy"),
        "cache": experts.get("cache"),
        "cpu_kernel": experts.get("cpu_kernel"),
        "cpu_layers": experts.get("cpu_layers"),
        "pcie_ms_per_expert": experts.get("pcie_cost_ms"),
        "cpu_ms_per_expert": experts.get("cpu_cost_ms"),
        # the fetch kernel's, where measured: a miss of the books kept on the device
        "fetch_ms_per_expert": experts.get("fetch_cost_ms"),
        # the measured bandwidths the split started from, and one expert's bytes: the bound's
        "b_p_gbps": experts.get("b_p_gbps"),
        "b_h_gbps": experts.get("b_h_gbps"),
        "expert_bytes": experts.get("expert_bytes"),
        "fetched_share": experts["q"] / experts["m"] if experts.get("m") else None,
        # experts fetched on the next layer's guessed routes (lookahead), since load
        "guessed": experts.get("guessed"),
        "placement": (experts.get("placement") or {}).get("mode"),
        "books": experts.get("books"),
        # what adaptive measured: step time per placement and per PCIe share, and the lane
        "placement_step_ms": (experts.get("placement") or {}).get("step_ms"),
        # the batch size (streams) the last decided measurement compared them at: a step's
        # time depends on it as much as on the placement
        "placement_batch": (experts.get("placement") or {}).get("batch"),
        # the batch sizes served in a placement of their own (streams: placement)
        "placement_by_batch": (experts.get("placement") or {}).get("by_batch"),
        "placement_moves": (experts.get("placement") or {}).get("moves"),
        # switches adaptive took back once the new placement served slower than its visits
        "placement_reverted": (experts.get("placement") or {}).get("reverted"),
        # measurements the miss gate skipped: the device's misses left nothing to gain
        "placement_skipped": (experts.get("placement") or {}).get("skipped"),
        "pcie_share": experts.get("pcie_share"),
        "lane": experts.get("lane"),
        "recent": stats.get("recent"),
        "decoded": stats.get("decoded"),  # tokens sampled since load
        "steps": stats.get("steps"),  # hit rate and misses per token, last few hundred tokens
        # the engine thread's time in steps and of it waiting for the device (ns, since
        # load), and the steps launched before the last one's tokens were read
        "busy_ns": stats.get("busy_ns"),
        "wait_ns": stats.get("wait_ns"),
        "ahead_steps": stats.get("ahead_steps"),
        "kv_pages_total": stats.get("kv_pages_total"),
        "kv_pages_free": stats.get("kv_pages_free"),
    }


@handler
async def cache(request: Request) -> Response:
    runners = services(request).residency.runners()
    models = [summary(name, await runner.stats()) for name, runner in sorted(runners.items())]
    return JSONResponse({"models": models})


@handler
async def resize(request: Request) -> Response:
    svc = services(request)
    body = parse_json(await request.body())
    name = field_of(body, "model", str)
    if not name:
        raise APIError(400, "model is required")
    view = await resolve(svc, name)
    runner = svc.residency.runners().get(view.display)
    if runner is None:
        raise APIError(404, f"model '{name}' is not loaded")
    request_body = {k: body[k] for k in ("size", "slots") if body.get(k) is not None}
    if not request_body:
        raise APIError(400, 'size (bytes or e.g. "12GiB") or slots is required')
    result = await runner.resize(request_body)
    return JSONResponse({"model": name, **result})
