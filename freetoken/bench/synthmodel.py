"""Benchmark models built in memory: a named shape (models/shapes.py) with seeded random
weights, built by the shape's own model file.

Weights are generated on the GPU (fast) as randn·0.02 in the model dtype; dense weights stay
there, expert banks are copied to host memory. Nothing touches the disk.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from freetoken import models
from freetoken.bench import packed
from freetoken.ftw.hostmem import HostBuffer, huge_pages_pay_here
from freetoken.layers.computed import reset_buffers
from freetoken.models.base import ExpertSpec
from freetoken.models.shapes import SHAPES
from freetoken.moe import setup
from freetoken.runtime import loader


@dataclass
class SynthModel:
    model: torch.nn.Module
    config: dict
    banks: dict  # (layer, bank) -> host tensor
    device: torch.device
    dtype: torch.dtype
    seconds: float
    formats: dict = field(default_factory=dict)  # (layer, bank) -> block format of packed banks


def build(
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    quant: str | None = None,
    layers: int = 0,
) -> SynthModel:
    """layers: the shape cut to this many layers (0: all). quant: the experts in a block
    format (q4_k, mxfp4, …, freetoken/quant), or laid out as `create --quantize` would
    (q4_K_M, q8_0); random blocks, since speed is what is measured."""
    t0 = time.perf_counter()
    config = dict(SHAPES[name])
    if layers:  # the shape cut to its first `layers` layers, as `bench serve --layers` cuts it
        config["num_hidden_layers"] = layers
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    g = torch.Generator(device=gen_device).manual_seed(seed)
    with torch.device("meta"):
        model = models.load_class(config).from_config(config)
    model.to_empty(device=device)
    experts = models.hub.num_experts(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if not p.is_floating_point():  # a token -> experts table: any expert ids
                p.data = torch.randint(0, experts, p.shape, generator=g, device=gen_device)
                p.data = p.data.to(device)
                continue
            kind = torch.float32 if loader.kept_in_fp32(model, pname) else dtype
            if pname.endswith("norm.weight"):
                p.data = torch.ones(p.shape, dtype=kind, device=device)
            else:
                p.data = (
                    torch.randn(p.shape, generator=g, device=gen_device, dtype=torch.float32) * 0.02
                ).to(device=device, dtype=kind)
    reset_buffers(model)
    spec = setup.expert_spec(model)
    formats = formats_for(quant, model.moe_layers, spec)
    banks = _expert_banks(model.moe_layers, spec, config, dtype, g, gen_device, formats)
    model.eval()
    return SynthModel(model, config, banks, device, dtype, time.perf_counter() - t0, formats)


def formats_for(qtype: str | None, layers: list[int], spec: ExpertSpec) -> dict:
    """Each expert matrix bank's block format under `qtype` (a format, or a quantize type)."""
    if not qtype:
        return {}
    from freetoken import quant
    from freetoken.quant.quantize import expert_format

    out = {}
    for i, layer in enumerate(layers):
        for bank in ("gate_up", "down"):
            cols = spec.rows()[bank][-1]
            fmt = (
                qtype
                if qtype in quant.FORMATS
                else expert_format(qtype, bank, i, len(layers), cols)
            )
            if fmt:
                out[(layer, bank)] = fmt
    return out


def _expert_banks(
    layers: list[int],
    spec: ExpertSpec,
    config: dict,
    dtype: torch.dtype,
    g: torch.Generator,
    gen_device: torch.device,
    formats: dict,
) -> dict:
    """Seeded random banks in fresh host mappings. From a GPU they go through one pinned
    staging buffer and then a multi-threaded host copy: a GPU copy straight into unpinned,
    never-touched pages faulted them in from one thread at ~1 GB/s (a minute for 54 GiB)."""
    E = models.hub.num_experts(config)
    shapes = [(bank, (E, *rows)) for bank, rows in spec.rows().items()]
    staging = None
    if gen_device.type == "cuda":
        staging = torch.empty(max(math.prod(s) for _, s in shapes), dtype=dtype, pin_memory=True)
    banks = {}
    for layer in layers:
        for bank, shape in shapes:
            fmt = formats.get((layer, bank))
            if fmt:  # random blocks, generated where the numbers are: speed is what matters
                banks[(layer, bank)] = packed.host_copy(
                    packed.random_packed(shape, fmt, g, gen_device)
                )
                continue
            n = math.prod(shape)
            # the pages a load would give them (packed.host_copy alike)
            buf = HostBuffer(
                n * torch.tensor([], dtype=dtype).element_size(), huge_pages_pay_here()
            )
            host = buf.tensor(str(dtype).removeprefix("torch."), list(shape), buf.nbytes)
            w = (
                torch.randn(shape, generator=g, device=gen_device, dtype=torch.float32)
                .mul_(0.02)
                .to(dtype)
            )
            if staging is not None:
                w = staging[:n].view(shape).copy_(w)
            host.copy_(w)
            banks[(layer, bank)] = host
    return banks
