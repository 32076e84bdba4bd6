"""The judgement `freetoken doctor MODEL` prints and a load logs: whether the model fits
this machine, where its weights go, which placement and policy it starts with, the decode
speed the bandwidths bound it to, and what to change where something falls short.

The bound is the design's: a decode step reads every routed expert that misses the GPU
cache once, over PCIe (B_P) or by the CPU kernel (B_H), so a token costs at least
    layers · k · (1 − f) · S / B
where f is the share of experts the cache holds (routing taken as uniform), S one expert's
bytes and B the placement's bandwidth. Dense layers on the GPU are not counted (they are
small next to the misses of a model larger than the GPU); on a CPU everything is read at B_H.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from freetoken.doctor.fit import HOST_SHARE, VRAM_SHARE, Needs, gib, needs
from freetoken.doctor.machine import Machine
from freetoken.doctor.model import ModelFacts
from freetoken.moe.locality import LOCALITY_STEPS, predict
from freetoken.moe.policy import Mode, Policy

__all__ = ["AGENT_CONTEXT", "Verdict", "judge"]

# Agents (OpenCode, OpenClaw) send ~10k tokens of instructions and tool schemas before the
# first user word and resend the whole history every turn: a window under this truncates
# them within a few turns.
AGENT_CONTEXT = 32768
_MODE_COST = {Mode.DEVICE: "B_P", Mode.SPLIT: "B_P + B_H", Mode.LAYERS: "B_H", Mode.CACHE: "~"}


@dataclass
class Verdict:
    fits: bool
    facts: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    tok_s: float | None = None
    mode: str = ""  # the placement decode starts in ("cpu" on a machine without a GPU)

    def lines(self) -> list[str]:
        return self.facts + [f"warning: {w}" for w in self.warnings]


_gib = gib


def judge(machine: Machine, model: ModelFacts, num_ctx: int, cfg: Any) -> Verdict:
    """The verdict for `model` loaded with a `num_ctx` window under settings `cfg`."""
    v = Verdict(fits=True)
    need = needs(model, num_ctx, cfg, on_gpu=bool(machine.gpus) and cfg.device != "cpu")
    if need.on_gpu:
        _on_gpu(v, machine, model, need, cfg)
    else:
        _on_cpu(v, machine, model, need)
    _warnings(v, machine, model, num_ctx)
    return v


def _host_fit(v: Verdict, machine: Machine, need: int, what: str) -> None:
    have = machine.ram_available
    v.facts.append(f"host RAM: {_gib(need)} for {what}, {_gib(have)} available")
    if have and need > have * HOST_SHARE:
        v.fits = False
        v.warnings.append(
            f"does not fit: {what} need {_gib(need)} of host RAM and {_gib(have)} is available "
            "(stop other models or programs, or use a machine with more memory)"
        )


def _on_cpu(v: Verdict, machine: Machine, model: ModelFacts, need: Needs) -> None:
    _host_fit(v, machine, need.host, "the weights and the KV cache")
    v.mode = "cpu"
    v.facts.append(f"placement: everything on the CPU ({machine.kernel.kernel} kernel)")
    step = model.dense_bytes + model.moe_layers * model.experts_per_token * model.expert_bytes
    v.tok_s = machine.b_h / max(step, 1)
    v.facts.append(f"decode: at most {v.tok_s:.1f} tok/s (every weight a token uses, read at B_H)")


def _on_gpu(v: Verdict, machine: Machine, model: ModelFacts, need: Needs, cfg: Any) -> None:
    _host_fit(v, machine, need.host, "the expert banks")
    budget = int(cfg.vram_budget) or int(machine.vram_free * VRAM_SHARE)
    kv = need.kv
    room = budget - (need.vram - need.cache)  # what the dense weights, KV and workspace leave
    L, E, S = model.moe_layers, model.experts, model.expert_bytes
    slots = min(max(room // max(S, 1), 0), L * E)
    if int(cfg.expert_slots):  # a slot count set by hand sizes the cache, not the budget
        slots = min(int(cfg.expert_slots), L * E)
    v.facts.append(
        f"GPU: {_gib(model.dense_bytes)} dense weights + {_gib(kv)} KV cache + "
        f"{slots} expert slots ({_gib(slots * S)}) of {_gib(budget)}"
    )
    if slots < E:
        v.fits = False
        v.warnings.append(
            f"does not fit: the GPU budget of {_gib(budget)} leaves room for {slots} experts "
            f"after the dense weights and KV cache; one layer's {E} are needed "
            "(a smaller num_ctx or FREETOKEN_KV_CACHE_SIZE frees room)"
        )
        return
    policy = Policy.parse(cfg.moe_policy)
    f = slots / max(L * E, 1)
    misses = L * model.experts_per_token * (1 - f)
    pcie, cpu = S / machine.b_p, S / machine.b_h
    if f >= 1:
        v.mode, per_miss = "resident", 0.0
        v.facts.append(f"placement: every expert on the GPU; policy {policy}")
    elif policy is Policy.ADAPTIVE:
        modes = (
            (Mode.DEVICE, Mode.SPLIT, Mode.LAYERS) if machine.pinned else (Mode.CACHE, Mode.LAYERS)
        )
        start = predict(modes, L, E, slots, pcie, cpu)
        v.mode = str(start)
        per_miss = {Mode.DEVICE: pcie, Mode.LAYERS: cpu}.get(start, pcie * cpu / (pcie + cpu))
        judged = start is not Mode.DEVICE and Mode.DEVICE in modes
        first = (
            f"serves up to {LOCALITY_STEPS} decode steps from 'device' (every miss kept), "
            f"then, where routing proves near-uniform, from '{start}'"
            if judged
            else f"starts in '{start}'"
        )
        v.facts.append(
            f"placement: {f:.0%} of the experts cached on the GPU; policy adaptive {first} "
            f"(misses at {_MODE_COST[start]}) and measures the others while serving"
        )
    else:
        v.mode = str(policy)
        per_miss = cpu if policy in (Policy.CPU_MISSES, Policy.STATIC_LAYERS) else pcie
        v.facts.append(f"placement: {f:.0%} of the experts cached on the GPU; policy {policy}")
    step = misses * per_miss
    v.tok_s = 1 / step if step > 0 else None
    if v.tok_s is not None:
        v.facts.append(
            f"decode: at most {v.tok_s:.1f} tok/s ({misses:.1f} expert misses a token at "
            f"{S / 2**20:.1f} MiB each; dense layers not counted)"
        )


def _warnings(v: Verdict, machine: Machine, model: ModelFacts, num_ctx: int) -> None:
    if num_ctx < AGENT_CONTEXT:
        v.warnings.append(
            f"num_ctx {num_ctx} is too small for coding agents (OpenCode and OpenClaw send "
            f"~10k tokens of instructions and tools, then the whole history each turn): set "
            f"PARAMETER num_ctx {AGENT_CONTEXT} in a Modelfile or "
            f"FREETOKEN_CONTEXT_LENGTH={AGENT_CONTEXT}"
        )
    if not model.converted:
        need = int(model.total_bytes * 1.05)
        if machine.disk_free < need:
            v.fits = False
            v.warnings.append(
                f"disk short for conversion: `freetoken create` writes {_gib(need)} into "
                f"{machine.store}, which has {_gib(machine.disk_free)} free"
            )
    if machine.gpus and not machine.pinned:
        v.warnings.append(
            f"host memory cannot be pinned ({machine.pinning}): the banks stay pageable and "
            "misses go through a pinned staging ring, slower than B_P"
        )
    if not machine.measured and machine.gpus:
        # a model's load times them before its cache is filled (moe/probe.py)
        v.warnings.append(
            "B_P and B_H are not measured on this machine yet: a model's first load times "
            "them on its own experts, `freetoken bench bw` measures them fully"
        )
    elif not machine.measured:
        v.warnings.append(
            "B_P and B_H are defaults until `freetoken bench bw` measures them on this machine"
        )
    elif not machine.by_bench and machine.gpus:
        # on a fresh H100 machine the probe read B_P 29.8 and B_H 44.2 GB/s: bench bw 50.2, 81.8
        v.warnings.append(
            "B_P and B_H were timed for a fraction of a second at a model's first load and may "
            "read low: `freetoken bench bw` measures them fully"
        )
