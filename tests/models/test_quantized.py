"""Quantized GGUF files of three families end to end: Q4_K_M files (Q4_K, with Q6_K for the
output head and some layers' expert down projections) and a Q8_0 one become FTW no larger than
1.3 × the file, continue text as transformers does with the weights the file decodes to, and
give the resident model's results under every expert policy (the banks stay packed: CPU
kernel, slot pool, fetches and prefill streaming all read blocks)."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.ftw.convert import convert
from tests import fixtures
from tests.fixtures_gguf import dequantized_model, write_gguf
from tests.models import family
from tests.runtime.engine_util import full_logits, generate, make_engine

# rows of 256 weights: whole K-quant blocks everywhere
SHAPE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=3)  # 3: prefill streams


def _olmoe(path):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from tests.models.test_olmoe import GGUF_CONFIG

    config = {**GGUF_CONFIG, **SHAPE, "num_attention_heads": 4, "num_key_value_heads": 4}
    return fixtures.hf_model(
        path,
        OlmoeConfig,
        OlmoeForCausalLM,
        config,
        seed=8,
        rerandomize_params=family.rerandomize_with_biases,
    )


def _qwen3(path):
    return fixtures.hf_qwen3_moe(path, seed=9, moe_intermediate_size=256, num_experts=4, **SHAPE)


def _ernie(path):
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    from tests.models.test_ernie4_5_moe import CONFIG

    config = {**CONFIG, **SHAPE, "moe_intermediate_size": 256, "moe_num_experts": 4}
    config["moe_layer_start_index"] = 0  # every layer routed, as the others here
    return fixtures.hf_model(
        path,
        Ernie4_5_MoeConfig,
        Ernie4_5_MoeForCausalLM,
        config,
        seed=10,
        rerandomize_params=family.rerandomize_with_biases,
    )


# family: (its transformers model, the file's type, the formats its expert down banks get)
CASES = {
    "qwen3moe": (_qwen3, "Q4_K_M", {"q4_k", "q6_k"}),
    "olmoe": (_olmoe, "Q8_0", {"q8_0"}),
    "ernie4_5-moe": (_ernie, "Q4_K_M", {"q4_k", "q6_k"}),
}


@pytest.fixture(scope="module", params=list(CASES))
def quantized(request, tmp_path_factory):
    arch = request.param
    build, qtype, downs = CASES[arch]
    path = tmp_path_factory.mktemp(arch)
    hf = build(path)
    gguf = write_gguf(hf, path, tmp_path_factory.mktemp("gguf") / "m.gguf", qtype, arch=arch)
    out = convert(gguf, tmp_path_factory.mktemp("ftw") / "m")
    return gguf, out, dequantized_model(hf, gguf, arch), hf.config, downs


def test_ftw_keeps_the_files_formats_and_size(quantized):
    gguf, out, _, config, downs = quantized
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size <= 1.3 * gguf.stat().st_size
    index = {t["name"]: t for t in json.loads((out / "ftw.json").read_text())["tensors"]}
    assert {index[f"down#L{i:05d}"]["quant"] for i in range(config.num_hidden_layers)} == downs


def test_greedy_tokens_are_transformers_on_the_decoded_weights(quantized):
    _, out, ref, _, _ = quantized
    (seq,) = generate(make_engine(out, dtype="float32"), [family.PROMPT], 16)
    assert seq.output_ids == fixtures.hf_greedy(ref, family.PROMPT, 16)


def test_every_policy_matches_resident(quantized):
    _, out, _, config, _ = quantized
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    family.policies_match_resident(out, experts, config.num_hidden_layers, dtype="float32")


@pytest.mark.parametrize(
    "mode,device",
    [
        ("split", "cpu"),
        ("layers", "cpu"),
        pytest.param("split", "cuda", marks=pytest.mark.gpu),
        pytest.param("layers", "cuda", marks=pytest.mark.gpu),
        pytest.param("device", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_adaptive_through_the_lane_and_device_books(quantized, mode, device):
    """Packed experts fetched by the device-kept books and computed by the CPU lane (a share
    of each layer's misses, or whole CPU layers), in CUDA graphs on a GPU: the tokens of
    transformers on the decoded weights. On a GPU the expert kernels fetch the misses as
    they compute them (FREETOKEN_FUSED_FETCH's default): every slot the books name then
    holds its expert's bytes."""
    from freetoken.moe import chooser

    _, out, ref, config, _ = quantized
    E = getattr(config, "num_experts", None) or config.num_local_experts
    engine = make_engine(
        out,
        policy="adaptive",
        slots={"split": E + 1, "device": E + 1, "layers": E}[mode],
        device=device,
        device_cache="on",
        cpu_lane="on",
        graphs="capture" if device == "cuda" else "",
        dtype="float32",
    )
    backend = family.experts_of(engine)
    backend.tuner.modes = chooser.ModeChooser(modes=(mode,))
    try:
        for prompt in (family.PROMPT, family.LONG):
            (seq,) = generate(engine, [prompt], 16)
            assert seq.output_ids == fixtures.hf_greedy(ref, prompt, 16)
        lane = backend.stats()["lane"]
        assert mode == "device" or lane["served"] > 0
        assert lane["failed"] == 0 and lane["timeouts"] == 0
        if device == "cuda" and mode != "layers":
            _slots_hold_their_experts(backend)
    finally:
        backend.lane.stop()


def _slots_hold_their_experts(backend) -> None:
    lru, E = backend.lru, backend.cache.E
    assert backend.stats()["cache"]["fetches"] > 0
    owners = lru.owner[:-1].cpu()
    for slot in (owners >= 0).nonzero().flatten().tolist():
        layer, e = divmod(int(owners[slot]), E)
        for name, bank in backend.banks.banks[layer].items():
            got = backend.cache.slots[name][slot].cpu().reshape(-1)[: bank[e].numel()]
            assert torch.equal(got, bank[e].reshape(-1)), (slot, name)


# How far BF16 logits may stray from fp32's, from BF16 compute measured alone on the CPU
# (make_engine(dtype="bfloat16") against "float32", PROMPT): qwen3moe 0.012. OLMoE's file
# gives 0.063 on the CPU as on a GPU: its first layer routes token 5 between experts whose
# fp32 logits differ by 0.0024, BF16's rounding of the router input (0.8%, as in
# transformers' own BF16 model) swaps them, and that row then differs by 0.19. ERNIE-4.5:
# 0.016. A broken kernel gives errors of order 1.
BF16_TOL = {"qwen3_moe": 3e-2, "olmoe": 0.1, "ernie4_5_moe": 3e-2}


def test_bf16_on_the_cpu_is_within_its_margin(quantized):
    """BF16_TOL's measurement, kept: BF16 compute alone, on the CPU."""
    _, out, _, config, _ = quantized
    want = full_logits(make_engine(out, dtype="float32"), family.PROMPT)
    got = full_logits(make_engine(out, dtype="bfloat16"), family.PROMPT)
    assert family.rel(got, want) <= BF16_TOL[config.model_type]


@pytest.mark.gpu
def test_on_a_gpu_in_bf16(quantized):
    """The default compute dtype (BF16) on a GPU with graphs, the decode kernels decoding on
    the fly: logits near fp32's on the CPU, and decode steps that agree with them."""
    _, out, _, config, _ = quantized
    engine = make_engine(out, device="cuda", graphs="capture")
    assert engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    want = full_logits(make_engine(out, dtype="float32"), family.PROMPT)
    tol = BF16_TOL[config.model_type]
    assert family.rel(full_logits(engine, family.PROMPT), want) <= tol
    (seq,) = generate(engine, [family.PROMPT], 8)
    (cpu,) = generate(make_engine(out, dtype="float32"), [family.PROMPT], 8)
    assert seq.output_ids[:2] == cpu.output_ids[:2]
