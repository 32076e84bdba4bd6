"""ERNIE-4.5 MoE against transformers on tiny random configs (fp32): rotary on adjacent
pairs, biases on every projection (`use_bias`) and none, a first dense layer and a dense
layer between MoE layers (`moe_layer_interval`), shared experts, softmax routing chosen with
a correction bias and renormalised, tied and untied embeddings; llama.cpp's ernie4_5-moe
GGUF; the multi-token-prediction block Hub checkpoints carry, skipped."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken import models
from freetoken.layers.routers import SoftmaxBiasedTopK
from freetoken.models import ernie4_5_moe
from tests import fixtures
from tests.models import family

CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    moe_num_experts=8,
    moe_k=2,
    moe_num_shared_experts=1,
    moe_layer_start_index=1,
    moe_layer_interval=1,
    use_bias=True,
    tie_word_embeddings=False,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def _build(tmp_path_factory, name, seed, original_format=True, **overrides):
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    path = tmp_path_factory.mktemp(name)
    hf = fixtures.hf_model(
        path,
        Ernie4_5_MoeConfig,
        Ernie4_5_MoeForCausalLM,
        {**CONFIG, **overrides},
        seed=seed,
        original_format=original_format,
        rerandomize_params=family.rerandomize_with_biases,
    )
    return path, hf


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return _build(tmp_path_factory, "ernie-moe", seed=61)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return _build(tmp_path_factory, "ernie-moe-fused", seed=62, original_format=False)


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


def test_gguf_import_matches_transformers(hub, tmp_path_factory):
    family.gguf_matches(*hub, tmp_path_factory.mktemp("gguf"), "ernie4_5-moe")


def test_no_biases_tied_embeddings_and_a_dense_layer_between(tmp_path_factory):
    """The released models' settings (no biases, tied embeddings), with MoE on every other
    layer from the second (layers 1 and 3; 0 and 2 dense); from llama.cpp's GGUF too."""
    path, hf = _build(
        tmp_path_factory,
        "ernie-moe-tied",
        seed=63,
        use_bias=False,
        tie_word_embeddings=True,
        num_hidden_layers=4,
        moe_layer_interval=2,
    )
    config = json.loads((path / "config.json").read_text())
    assert ernie4_5_moe.Model.from_config(config).moe_layers == [1, 3]
    family.logits_match(path, hf)
    family.greedy_matches(path, hf)
    family.gguf_matches(path, hf, tmp_path_factory.mktemp("gguf-tied"), "ernie4_5-moe")


def test_the_hub_spelling_and_the_multi_token_prediction_block(hub, tmp_path):
    """Hub configs spell rope_theta at the top level; Hub checkpoints keep an MTP block
    (`model.mtp_*`) after the layers, which the model skips."""
    path, hf = hub
    config = json.loads((path / "config.json").read_text())
    model = ernie4_5_moe.Model.from_config(config)
    assert ernie4_5_moe.ModelArgs.from_dict(family.hub_spelling(config)) == model.args
    assert model.moe_layers == [1, 2] and model.args.moe_layer_end_index == 2
    mtp = tmp_path / "mtp"
    mtp.mkdir()
    for f in path.iterdir():
        (mtp / f.name).write_bytes(f.read_bytes())
    [weights] = sorted(mtp.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.mtp_linear_proj.0.weight"] = torch.randn(64, 128)
    tensors["model.mtp_block.0.self_attn.q_proj.weight"] = torch.randn(64, 64)
    save_file(tensors, weights)
    index = mtp / "model.safetensors.index.json"
    if index.exists():  # the index names every tensor
        data = json.loads(index.read_text())
        data["weight_map"] |= {k: weights.name for k in tensors}
        index.write_text(json.dumps(data))
    family.logits_match(mtp, hf)


def test_model_info_and_the_expert_counts_of_its_spelling(hub):
    """`moe_num_experts` and `moe_k` are this family's spelling: the torch-free description
    (before a model is converted) reads them too."""
    config = json.loads((hub[0] / "config.json").read_text())
    generic = models.model_info(config)
    assert generic["general.architecture"] == "ernie4_5-moe"
    assert generic["ernie4_5-moe.expert_count"] == 8
    assert generic["ernie4_5-moe.expert_used_count"] == 2
    info = ernie4_5_moe.Model.model_info(config)
    assert info["ernie4_5-moe.expert_shared_count"] == 1
    assert info["ernie4_5-moe.leading_dense_block_count"] == 1
    assert info["ernie4_5-moe.interleave_moe_layer_step"] == 1


def test_the_router_holds_the_renormalising_sum_at_its_minimum():
    """Where the chosen probabilities sum below `norm_min`, they are divided by it, not by
    their sum (transformers' clamp): weights stay below one."""
    router = SoftmaxBiasedTopK(4, 8, 2, norm_min=0.9)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 4))
        router.e_score_correction_bias.copy_(torch.linspace(0, 10, 8)[None])
    x = torch.randn(5, 4)
    weights, ids = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    # the bias, 10/7 apart from one expert to the next, outweighs any probability
    assert torch.equal(ids.sort(dim=-1).values, torch.tensor([[6, 7]] * 5))
    chosen = probs.gather(1, ids)
    assert (chosen.sum(dim=-1) < 0.9).any()  # the minimum is met
    want = chosen / chosen.sum(dim=-1, keepdim=True).clamp(min=0.9)
    assert torch.allclose(weights, want)


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs(hub):
    family.gpu_matches(*hub)
