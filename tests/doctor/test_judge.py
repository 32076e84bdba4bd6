"""The judgement on made-up machines and models: the numbers the bound gives, the placement
adaptive starts in, and each warning where its condition holds and only there."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from freetoken import config
from freetoken.doctor.judge import AGENT_CONTEXT, judge
from freetoken.doctor.machine import Gpu, Machine
from freetoken.doctor.model import ModelFacts
from freetoken.kernels.cpu import Status

GiB = 2**30


def machine(**kw) -> Machine:
    base = Machine(
        torch_build="test",
        gpus=[Gpu(0, "test GPU", 24 * GiB, 23 * GiB)],
        cores=16,
        ram_total=128 * GiB,
        ram_available=120 * GiB,
        memlock=None,
        pinning="ok",
        store=Path("/store"),
        disk_free=500 * GiB,
        kernel=Status("C++ (avx512)", "test"),
        b_p=25e9,
        b_h=50e9,
        measured=True,
        by_bench=True,
    )
    return dataclasses.replace(base, **kw)


def qwen30b(**kw) -> ModelFacts:
    """Qwen3-30B-A3B's shape in BF16: 48 layers of 128 experts (9 MiB each), 8 a token."""
    expert = 3 * 2048 * 768 * 2
    base = ModelFacts(
        name="qwen3-30b",
        bank_bytes=48 * 128 * expert,
        dense_bytes=int(1.5 * GiB),
        moe_layers=48,
        experts=128,
        experts_per_token=8,
        context_length=40960,
        kv_bytes_per_token=2 * 48 * 4 * 128 * 2,
    )
    return dataclasses.replace(base, **kw)


@pytest.fixture
def cfg():
    return config.load({})


def test_a_model_larger_than_the_gpu_fits_with_a_cache_and_a_bound(cfg):
    v = judge(machine(), qwen30b(), AGENT_CONTEXT, cfg)
    assert v.fits and v.warnings == []
    assert v.mode in ("device", "split", "layers")
    assert v.tok_s is not None and 10 < v.tok_s < 1000
    [fact] = [f for f in v.facts if f.startswith("placement: ")]
    # served from device until the routing is judged, the prediction named where it differs
    assert "policy adaptive" in fact and f"'{v.mode}'" in fact and "'device'" in fact
    # a bigger GPU caches more experts: fewer misses, a higher bound
    big = judge(machine(gpus=[Gpu(0, "big", 80 * GiB, 50 * GiB)]), qwen30b(), AGENT_CONTEXT, cfg)
    assert big.tok_s is None or big.tok_s > v.tok_s


def test_every_expert_on_a_large_gpu_is_resident(cfg):
    v = judge(machine(gpus=[Gpu(0, "h200", 140 * GiB, 139 * GiB)]), qwen30b(), AGENT_CONTEXT, cfg)
    assert v.fits and v.mode == "resident"


def test_a_slot_count_set_by_hand_sizes_the_cache():
    """FREETOKEN_EXPERT_SLOTS caps the cache on a GPU with room for every expert: the verdict
    speaks of that cache, not of the room."""
    h200 = machine(gpus=[Gpu(0, "h200", 140 * GiB, 139 * GiB)])
    v = judge(h200, qwen30b(), AGENT_CONTEXT, config.load({"FREETOKEN_EXPERT_SLOTS": "1536"}))
    assert v.mode != "resident"
    assert any("1536 expert slots" in f for f in v.facts)
    assert any("25% of the experts cached" in f for f in v.facts)


def test_too_little_ram_or_vram_does_not_fit_and_says_the_numbers(cfg):
    v = judge(machine(ram_available=20 * GiB), qwen30b(), AGENT_CONTEXT, cfg)
    assert not v.fits and "need 54.0 GiB of host RAM and 20.0 GiB is available" in v.warnings[0]
    v = judge(machine(gpus=[Gpu(0, "small", 4 * GiB, 2 * GiB)]), qwen30b(), AGENT_CONTEXT, cfg)
    assert not v.fits and "one layer's 128 are needed" in v.warnings[0]


def test_without_a_gpu_everything_is_read_at_b_h(cfg):
    m = machine(gpus=[], pinning="not needed without a GPU")
    v = judge(m, qwen30b(), AGENT_CONTEXT, cfg)
    step = qwen30b().dense_bytes + 48 * 8 * qwen30b().expert_bytes
    assert v.mode == "cpu" and v.tok_s == pytest.approx(50e9 / step)


def test_warnings_name_what_to_change(cfg):
    v = judge(machine(measured=False), qwen30b(), 4096, cfg)
    text = " ".join(v.warnings)
    assert "num_ctx 4096 is too small for coding agents" in text
    assert f"FREETOKEN_CONTEXT_LENGTH={AGENT_CONTEXT}" in text
    assert "`freetoken bench bw`" in text
    assert "a model's first load times them" in text  # a GPU machine's load probes them
    cpu_only = machine(measured=False, gpus=[], pinning="not needed without a GPU")
    assert "are defaults until" in " ".join(judge(cpu_only, qwen30b(), 4096, cfg).warnings)
    probed = " ".join(judge(machine(by_bench=False), qwen30b(), 4096, cfg).warnings)
    assert "timed for a fraction of a second at a model's first load" in probed
    assert "first load" not in " ".join(judge(machine(), qwen30b(), 4096, cfg).warnings)
    refused = machine(pinning="refused: cudaHostRegister of 2 MiB failed with error 2")
    v = judge(refused, qwen30b(), AGENT_CONTEXT, cfg)
    assert v.fits and "staging ring" in v.warnings[0] and v.mode in ("cache", "layers")


def test_a_source_not_converted_needs_disk_for_the_conversion(cfg):
    source = qwen30b(converted=False, source_bytes=57 * GiB)
    v = judge(machine(disk_free=30 * GiB), source, AGENT_CONTEXT, cfg)
    assert not v.fits and any(w.startswith("disk short for conversion") for w in v.warnings)
    assert judge(machine(), source, AGENT_CONTEXT, cfg).fits
