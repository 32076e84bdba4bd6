"""A follower rank: loads its share of every MoE layer's experts, then serves rank 0's operations.

    python -m freetoken.dist.follower WORKDIR RANK PARENT_PID

Started by `freetoken.dist.group.launch`, never by hand. It holds no dense weights and no
KV cache: its GPU is all expert cache. It exits on STOP, and as soon as rank 0 is gone.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import traceback
from pathlib import Path

import torch

from freetoken import config as settings
from freetoken.dist import experts as dx
from freetoken.dist.group import (
    EXIT_FOLLOWED,
    EXPERTS,
    RESIZE,
    STATS,
    STOP,
    WARM,
    Group,
    use,
    watch_parent,
)
from freetoken.ftw import sources
from freetoken.kernels import cpu as cpu_kernel
from freetoken.models.hub import num_experts, text_config
from freetoken.moe import setup
from freetoken.moe.offload import OffloadExperts

log = logging.getLogger("freetoken.follower")


def load(group: Group, spec: dict) -> OffloadExperts:
    files = {name: Path(p) for name, p in spec["files"].items()}
    cpu_kernel.extension()
    banks, dtype, expert_spec, formats = sources.load_banks(
        files,
        group.device.type,
        spec["dtype"],
        group.experts,
        huge_pages=settings.current().huge_pages,
    )
    placement = dict(spec["placement"])
    placement["cache_dir"] = Path(placement["cache_dir"]) if placement["cache_dir"] else None
    return setup.build(
        banks,
        expert_spec,
        group.device,
        dtype,
        setup.Placement(**placement),
        ranks_on_host=group.world,
        formats=formats,
    )


def serve(group: Group, backend: OffloadExperts | None, hidden: int) -> None:
    """Rank 0's operations until STOP. A follower that failed to load only waits for STOP."""
    dtype = backend.banks.dtype if backend is not None else None
    while True:
        op, a, b, c = group.recv()
        if op == STOP:
            return
        if op == EXPERTS:
            layer, T, k = a, b, c
            if layer == backend.banks.layers[0]:  # a step begins, as rank 0's engine said
                backend.between_steps(T)
            buf = torch.empty(
                dx.payload_bytes(T, k, hidden, dtype), dtype=torch.uint8, device=group.device
            )
            group.broadcast(buf)
            x, ids, weights = dx.unpack(buf, T, k, hidden, dtype)
            group.reduce(dx.local_part(backend, group.experts, layer, x, ids, weights))
        elif op == RESIZE:
            group.gather(dx.try_resize(backend, a))
        elif op == STATS:
            group.gather(backend.stats())
        elif op == WARM:
            backend.warm(a)


def main(argv: list[str] | None = None) -> None:
    workdir, rank, parent = argv if argv is not None else sys.argv[1:]
    rank = int(rank)
    cfg = settings.current()
    logging.basicConfig(
        level=logging.DEBUG if cfg.debug else logging.INFO,
        format=f"%(asctime)s rank {rank} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    threading.Thread(target=watch_parent, args=(int(parent),), daemon=True).start()
    spec = json.loads((Path(workdir) / "spec.json").read_text())
    config = json.loads(Path(spec["files"]["config.json"]).read_text())
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    use(spec["devices"][rank])
    group = Group(rank, spec["devices"], Path(workdir), num_experts(config))
    group.join()
    backend = None
    try:
        backend = load(group, spec)
        mine = dx.status(group, backend)
    except Exception as e:  # rank 0 reports it, by rank, as the runner's load error
        log.error("loading experts %s failed: %s", group.experts, traceback.format_exc())
        mine = dx.status(group, None, f"{type(e).__name__}: {e}")
    try:
        group.gather(mine)
        serve(group, backend, int(text_config(config)["hidden_size"]))
    except Exception as e:  # rank 0 or another rank is gone: nothing left to serve
        log.error("the group failed: %s", e)
        os._exit(EXIT_FOLLOWED)
    if backend is not None:
        backend.close()
    group.leave()


if __name__ == "__main__":
    main()
