"""DeepSeek-V3 against transformers on tiny random configs (fp32, decisive routing).

Three configs between them set every option: low-rank q and a plain q_proj; YaRN with an
attention factor (mscale != mscale_all_dim) and with DeepSeek's softmax correction alone,
and plain rope; rotary pairs interleaved and halves; a leading dense layer and none;
n_group > 1 with topk_group < n_group, and one group; routed scaling != 1; renormalised
top-k and not; attention biases; the Hub's per-expert layout and config spelling, and
transformers 5's fused layout and spelling.
"""

from __future__ import annotations

import pytest

from tests.models import family, mla

LORA = dict(
    mla.BASE,
    q_lora_rank=24,
    rope_parameters=mla.yarn(1.0, 0.8),
    rope_interleave=True,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    attention_bias=True,
)
PLAIN = dict(
    mla.BASE,
    q_lora_rank=None,
    rope_parameters=mla.DEFAULT_ROPE,
    rope_interleave=False,
    first_k_dense_replace=0,
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    n_shared_experts=2,
)
# what llama.cpp can say of it (mscale == mscale_all_dim, rotary pairs interleaved)
GGUF = dict(LORA, rope_parameters=mla.yarn(0.707, 0.707, factor=8.0), attention_bias=False)


def _build(tmp_path_factory, name, config, seed, **kw):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = tmp_path_factory.mktemp(name)
    return path, mla.build(path, DeepseekV3Config, DeepseekV3ForCausalLM, config, seed, **kw)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    path, hf = _build(tmp_path_factory, "ds3-lora", LORA, seed=11)
    mla.hub_spelling(path)
    return path, hf


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _build(tmp_path_factory, "ds3-plain", PLAIN, seed=12, original_format=False)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    return _build(tmp_path_factory, "ds3-gguf", GGUF, seed=13)


@pytest.mark.parametrize("fixture", ["lora", "plain", "gguf_model"])
def test_logits_match_transformers(fixture, request):
    path, hf = request.getfixturevalue(fixture)
    family.logits_match(path, hf)


@pytest.mark.parametrize("fixture", ["lora", "plain"])
def test_cached_decode_equals_uncached_forward(fixture, request):
    path, _ = request.getfixturevalue(fixture)
    family.cached_decode_matches(path)


@pytest.mark.parametrize("fixture", ["lora", "plain"])
def test_greedy_continuation_matches_transformers(fixture, request):
    path, hf = request.getfixturevalue(fixture)
    family.greedy_matches(path, hf)


def test_batched_sequences_match_single(lora):
    family.batched_matches_single(*lora)


def test_every_policy_streaming_and_resize_equal_resident(lora):
    path, hf = lora
    family.policies_match_resident(path, hf.config.n_routed_experts, moe_layers=2)


@pytest.mark.parametrize("fixture", ["lora", "plain"])
def test_fixed_shape_decode_gives_the_same_tokens(fixture, request):
    mla.fixed_shape_decode_matches(*request.getfixturevalue(fixture))


@pytest.mark.parametrize("split_kv_b", [True, False])
def test_gguf_import_matches_transformers(gguf_model, tmp_path, split_kv_b):
    path, hf = gguf_model
    mla.gguf_matches(hf, path, tmp_path, "deepseek_v3", split_kv_b=split_kv_b)


def test_show_describes_the_model(lora, tmp_path):
    info = mla.show_describes(*lora, tmp_path, "deepseek2")
    assert info["deepseek2.leading_dense_block_count"] == 1
    assert info["deepseek2.expert_gating_func"] == 2
    assert info["deepseek2.rope.scaling.type"] == "yarn"


def test_model_file_reads_both_spellings(lora, plain):
    import json

    from freetoken.models.deepseek_v3 import ModelArgs

    a = ModelArgs.from_dict(json.loads((lora[0] / "config.json").read_text()))
    assert a.q_lora_rank == 24 and a.dense_layers == (0,) and a.n_group == 4
    assert a.rope_scaling.kind == "yarn" and a.rope_scaling.mscale_all_dim == 0.8
    b = ModelArgs.from_dict(json.loads((plain[0] / "config.json").read_text()))
    assert b.q_lora_rank is None and b.dense_layers == () and not b.rope_interleave
    assert b.num_experts == 8 and b.rope_scaling.kind == "default"


@pytest.mark.gpu
@pytest.mark.parametrize("policy,slots", [("resident", 0), ("lru-pcie", 9)])
def test_captured_decode_on_a_gpu_matches_transformers(lora, policy, slots):
    mla.captured_decode_matches(*lora, policy, slots)
