"""Quantized GGUF files of two families end to end: a Q4_K_M file (Q4_K, with Q6_K for the
output head and some layers' expert down projections) and a Q8_0 one become FTW no larger than
1.3 × the file, continue text as transformers does with the weights the file decodes to, and
give the resident model's results under every expert policy (the banks stay packed: CPU
kernel, slot pool, fetches and prefill streaming all read blocks)."""

from __future__ import annotations

import json

import pytest

from freetoken.ftw.convert import convert
from tests import fixtures
from tests.fixtures_gguf import dequantized_model, write_gguf
from tests.models import family
from tests.runtime.engine_util import generate, make_engine

# rows of 256 weights: whole K-quant blocks everywhere
SHAPE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2)


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


# family: (its transformers model, the file's type, the formats its expert down banks get)
CASES = {
    "qwen3moe": (_qwen3, "Q4_K_M", {"q4_k", "q6_k"}),
    "olmoe": (_olmoe, "Q8_0", {"q8_0"}),
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
