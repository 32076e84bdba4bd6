"""GLM-4.7-Flash (glm4_moe_lite) against transformers on tiny random configs (fp32,
decisive routing): DeepSeek-V3's computation under GLM's config, dense layers named by
`mlp_layer_types` (transformers 5) or `first_k_dense_replace` (the Hub).

Two configs between them: low-rank q and a plain q_proj; rotary pairs interleaved and
halves; plain rope and YaRN with an attention factor; n_group > 1 with topk_group <
n_group, and one group; renormalised top-k and not; routed scaling != 1; both layouts and
spellings. Its GGUF files are llama.cpp's deepseek2 (read as DeepSeek-V3) or Ollama's
glm4moelite.
"""

from __future__ import annotations

import pytest

from tests.models import family, mla

FLASH = dict(
    mla.BASE,
    q_lora_rank=24,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    rope_interleave=True,
    mlp_layer_types=["dense", "sparse", "sparse"],
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.8,
    rms_norm_eps=1e-5,
)
YARN = dict(
    mla.BASE,
    q_lora_rank=None,
    rope_parameters=mla.yarn(1.0, 0.8),
    rope_interleave=False,
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
)


def _build(tmp_path_factory, name, config, seed, **kw):
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    path = tmp_path_factory.mktemp(name)
    return path, mla.build(path, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, config, seed, **kw)


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    path, hf = _build(tmp_path_factory, "glm-flash", FLASH, seed=31)
    mla.hub_spelling(path)
    return path, hf


@pytest.fixture(scope="module")
def yarn(tmp_path_factory):
    return _build(tmp_path_factory, "glm-yarn", YARN, seed=32, original_format=False)


@pytest.mark.parametrize("fixture", ["flash", "yarn"])
def test_logits_match_transformers(fixture, request):
    path, hf = request.getfixturevalue(fixture)
    family.logits_match(path, hf)


@pytest.mark.parametrize("fixture", ["flash", "yarn"])
def test_cached_decode_equals_uncached_forward(fixture, request):
    path, _ = request.getfixturevalue(fixture)
    family.cached_decode_matches(path)


@pytest.mark.parametrize("fixture", ["flash", "yarn"])
def test_greedy_continuation_matches_transformers(fixture, request):
    path, hf = request.getfixturevalue(fixture)
    family.greedy_matches(path, hf)


def test_batched_sequences_match_single(flash):
    family.batched_matches_single(*flash)


def test_every_policy_streaming_and_resize_equal_resident(flash):
    path, hf = flash
    family.policies_match_resident(path, hf.config.n_routed_experts, moe_layers=2)


def test_fixed_shape_decode_gives_the_same_tokens(yarn):
    mla.fixed_shape_decode_matches(*yarn)


@pytest.mark.parametrize(
    "arch,model_type", [("deepseek2", "deepseek_v3"), ("glm4moelite", "glm4_moe_lite")]
)
def test_gguf_import_matches_transformers(flash, tmp_path, arch, model_type):
    path, hf = flash
    mla.gguf_matches(hf, path, tmp_path, model_type, arch=arch)


def test_show_describes_the_model(flash, tmp_path):
    info = mla.show_describes(*flash, tmp_path, "glm4moelite")
    assert info["glm4moelite.leading_dense_block_count"] == 1


def test_dense_layers_from_either_spelling(flash, yarn):
    import json

    from freetoken.models.glm4_moe_lite import ModelArgs

    for path, _ in (flash, yarn):
        c = json.loads((path / "config.json").read_text())
        assert ("mlp_layer_types" in c) == (path == yarn[0])
        assert ModelArgs.from_dict(c).dense_layers == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("policy,slots", [("resident", 0), ("lru-pcie", 9)])
def test_captured_decode_on_a_gpu_matches_transformers(flash, policy, slots):
    mla.captured_decode_matches(*flash, policy, slots)
