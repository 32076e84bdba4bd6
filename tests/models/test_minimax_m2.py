"""MiniMax-M2 against transformers on tiny random configs (fp32): q/k RMSNorm over the
whole projection, partial rotary (rotary_dim half the head), sigmoid routing by score plus
a correction bias (a router test against transformers' own module too), the Hub's
block_sparse_moe names and transformers 5's fused banks, and llama.cpp's minimax-m2
GGUF."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.layers import fused
from freetoken.layers.routers import SigmoidGroupedTopK
from freetoken.models import minimax_m2
from tests import fixtures
from tests.models import family

# transformers 5.17 (on the GPU machine) builds a different MiniMax-M2 from the same config
# (its logits differ from 5.24's by 35 %, on the CPU as on the GPU): the reference is 5.24's
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24),
    reason=f"the reference is transformers 5.24's MiniMax-M2, not {transformers.__version__}'s",
)

CONFIG = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rotary_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 5e6},
    bos_token_id=None,
    eos_token_id=None,
)


def _build(tmp_path_factory, name, seed, original_format=True):
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    path = tmp_path_factory.mktemp(name)
    hf = fixtures.hf_model(
        path,
        MiniMaxM2Config,
        MiniMaxM2ForCausalLM,
        CONFIG,
        seed=seed,
        original_format=original_format,
        rerandomize_params=family.rerandomize_with_biases,
    )
    return path, hf


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """block_sparse_moe.{gate, e_score_correction_bias, experts.{e}.w1/w2/w3}."""
    return _build(tmp_path_factory, "minimax-m2", seed=41)


@pytest.fixture(scope="module")
def fused_layout(tmp_path_factory):
    """mlp.{gate, e_score_correction_bias, experts.gate_up_proj/down_proj}."""
    return _build(tmp_path_factory, "minimax-m2-fused", seed=42, original_format=False)


@pytest.mark.parametrize("layout", ["hub", "fused_layout"])
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


def test_router_matches_transformers_router():
    """SigmoidGroupedTopK with one group is MiniMax-M2's router (its correction bias held
    by the MoE block there, passed in)."""
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    g = torch.Generator().manual_seed(5)
    cfg = MiniMaxM2Config(hidden_size=64, num_local_experts=16, num_experts_per_tok=4)
    ref = MiniMaxM2TopKRouter(cfg)
    ours = SigmoidGroupedTopK(64, 16, 4, norm_topk_prob=True)
    with torch.no_grad():
        ref.weight.copy_(torch.randn((16, 64), generator=g) / 8)
        ours.weight.copy_(ref.weight)
        ours.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=g))
    x = torch.randn((9, 64), generator=g)
    _, want_w, want_ids = ref(x, ours.e_score_correction_bias.detach())
    with fused.disabled():
        w, ids = ours(x)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.allclose(w.gather(1, order), want_w.gather(1, want_order), atol=1e-6)


def test_structure_follows_the_config(hub):
    path, _ = hub
    config = json.loads((path / "config.json").read_text())
    model = minimax_m2.Model.from_config(config)
    assert model.args.rotary_dim == 16 and model.model.rotary.head_dim == 16
    hub_config = {**family.hub_spelling(config), "qk_norm_type": "per_layer"}
    hub_config.pop("partial_rotary_factor")  # the Hub's configs say rotary_dim
    assert minimax_m2.ModelArgs.from_dict(hub_config) == model.args
    assert minimax_m2.Model.dense_key("model.layers.0.mlp.e_score_correction_bias") == (
        "model.layers.0.mlp.gate.e_score_correction_bias"
    )
    with pytest.raises(ValueError, match="qk_norm_type"):
        minimax_m2.ModelArgs.from_dict({**hub_config, "qk_norm_type": "per_head"})
    info = minimax_m2.Model.model_info(config)
    assert info["minimax-m2.rope.dimension_count"] == 16
    assert info["minimax-m2.expert_feed_forward_length"] == 32


def test_gguf_import_matches_transformers(hub, tmp_path_factory):
    family.gguf_matches(*hub, tmp_path_factory.mktemp("gguf"), "minimax-m2")


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs(hub):
    family.gpu_matches(*hub)
