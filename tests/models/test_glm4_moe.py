"""GLM-4.5 against transformers on tiny random configs (fp32): q/k/v biases without an
output bias, per-head q/k norms, partial rotary, a head dim other than hidden/heads, a
first dense layer, shared experts, grouped sigmoid routing with a correction bias and a
routed scaling factor; llama.cpp's glm4moe GGUF; the multi-token-prediction layer GLM
checkpoints append, skipped in both formats; GLM-4.5-Air's missing q/k norms."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from freetoken.models import glm4_moe
from tests import fixtures
from tests.fixtures_gguf import write_gguf
from tests.models import family
from tests.runtime.engine_util import full_logits, make_engine

CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # not hidden / heads
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    attention_bias=True,
    use_qk_norm=True,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def _build(tmp_path_factory, name, seed, original_format=True, **overrides):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    path = tmp_path_factory.mktemp(name)
    hf = fixtures.hf_model(
        path,
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        {**CONFIG, **overrides},
        seed=seed,
        original_format=original_format,
        rerandomize_params=family.rerandomize_with_biases,
    )
    return path, hf


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return _build(tmp_path_factory, "glm4-moe", seed=51)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return _build(tmp_path_factory, "glm4-moe-fused", seed=52, original_format=False)


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_logits_and_greedy_tokens_match_transformers(layout, request):
    path, hf = request.getfixturevalue(layout)
    family.logits_match(path, hf)
    family.greedy_matches(path, hf)


def test_cached_decode_equals_uncached_forward(hub):
    family.cached_decode_matches(hub[0])


def test_batched_sequences_match_single(hub):
    family.batched_matches_single(*hub)


def test_every_policy_matches_resident(hub):
    family.policies_match_resident(hub[0], num_experts=8, moe_layers=2)


def test_structure_follows_the_config(hub):
    path, _ = hub
    config = json.loads((path / "config.json").read_text())
    model = glm4_moe.Model.from_config(config)
    assert model.moe_layers == [1, 2] and model.args.rotary_dim == 16
    assert model.model.layers[1].mlp.shared_experts.gate_proj.weight.shape == (32, 64)
    assert glm4_moe.ModelArgs.from_dict(family.hub_spelling(config)) == model.args
    # transformers' default when a config names no factor
    no_factor = {k: v for k, v in family.hub_spelling(config).items() if "partial" not in k}
    assert glm4_moe.ModelArgs.from_dict(no_factor).rotary_dim == 16
    info = glm4_moe.Model.model_info(config)
    assert info["glm4moe.leading_dense_block_count"] == 1
    assert info["glm4moe.expert_weights_scale"] == 2.5 and info["glm4moe.expert_group_count"] == 2


def test_gguf_import_matches_transformers(hub, tmp_path_factory):
    family.gguf_matches(*hub, tmp_path_factory.mktemp("gguf"), "glm4moe")


def test_air_without_qk_norms(tmp_path_factory):
    path, hf = _build(tmp_path_factory, "glm4-moe-air", seed=53, use_qk_norm=False)
    family.logits_match(path, hf)
    family.gguf_matches(path, hf, tmp_path_factory.mktemp("gguf-air"), "glm4moe")


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory):
    """A checkpoint with one more layer than its config runs (GLM's multi-token-prediction
    layer), and transformers' model without it as the reference."""
    path, hf = _build(tmp_path_factory, "glm4-moe-mtp", seed=54, num_hidden_layers=4)
    config = json.loads((path / "config.json").read_text())
    config |= {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}
    (path / "config.json").write_text(json.dumps(config))
    eh_proj = torch.zeros((64, 128))  # one of the layer's own MTP tensors
    save_file({"model.layers.3.eh_proj.weight": eh_proj}, str(path / "mtp.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"]["model.layers.3.eh_proj.weight"] = "mtp.safetensors"
        index.write_text(json.dumps(data))
    ref = copy.deepcopy(hf)
    ref.model.layers = ref.model.layers[:3]
    ref.config.num_hidden_layers = 3
    return path, hf, ref


def test_multi_token_prediction_layers_are_skipped(with_mtp, tmp_path):
    from freetoken.ftw.convert import convert

    path, full, ref = with_mtp
    want = fixtures.hf_logits(ref, family.PROMPT)
    assert family.rel(full_logits(make_engine(path), family.PROMPT), want) <= 1e-4
    # GGUF: block_count counts the MTP layer, nextn_predict_layers says it is one
    nextn = {"blk.3.nextn.eh_proj.weight": np.zeros((64, 128), np.float32)}
    gguf = write_gguf(full, path, tmp_path / "m.gguf", arch="glm4moe", nextn=1, extra=nextn)
    out = convert(gguf, tmp_path / "ftw")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3
    assert family.rel(full_logits(make_engine(out), family.PROMPT), want) <= 1e-4


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs(hub):
    family.gpu_matches(*hub)


def test_grouped_router_matches_transformers_router():
    """SigmoidGroupedTopK is GLM-4.5's router: groups scored by their two best experts,
    the kept groups' top-k, weights renormalised and scaled."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from freetoken.layers import fused
    from freetoken.layers.routers import SigmoidGroupedTopK

    g = torch.Generator().manual_seed(6)
    cfg = Glm4MoeConfig(
        hidden_size=64,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    ref = Glm4MoeTopkRouter(cfg)
    ours = SigmoidGroupedTopK(64, 16, 4, n_group=4, topk_group=2, routed_scaling=2.5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn((16, 64), generator=g) / 8)
        ref.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=g))
    ours.load_state_dict(ref.state_dict())
    x = torch.randn((9, 64), generator=g)
    _, want_w, want_ids = ref(x)
    with fused.disabled():
        w, ids = ours(x)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.allclose(w.gather(1, order), want_w.gather(1, want_order), atol=1e-6)
