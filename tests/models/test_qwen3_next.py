"""Qwen3-Next against transformers on tiny random configs (fp32): Gated DeltaNet layers
(value heads sharing key heads, or not) beside gated attention layers with partial rotary,
the layer pattern from full_attention_interval or an explicit layer_types, a dense MLP
layer among MoE layers with a sigmoid-gated shared expert, renormalised top-k or not,
attention biases, the Hub's per-expert tensors and transformers 5's fused banks.

A DeltaNet layer's state lives in a slot per sequence: prefill chunks carry it across
steps, decode steps continue it (also in the fixed-shape decode step CUDA graphs
capture), batched sequences keep theirs apart and a preempted sequence starts again from
zero state."""

from __future__ import annotations

import json

import pytest
import torch

from freetoken import models
from freetoken.models import qwen3_next
from tests import fixtures
from tests.models import family
from tests.runtime.engine_util import generate, make_engine

pytest.importorskip("transformers")

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
)
# every other layer attention, a dense MLP layer, two value heads per key head
INTERVAL = dict(
    BASE,
    num_hidden_layers=4,
    full_attention_interval=2,
    mlp_only_layers=[2],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
)
# attention first, then DeltaNet layers with as many value heads as key heads
LISTED = dict(
    BASE,
    num_hidden_layers=3,
    layer_types=["full_attention", "linear_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    norm_topk_prob=False,
    attention_bias=True,
    rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
)


def rerandomize(model: torch.nn.Module, seed: int) -> None:
    """fixtures' ranges, biases near zero, and decays e^{A_log} in (0.05, 1): slow enough
    that a DeltaNet state carries far."""
    family.rerandomize_with_biases(model, seed)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(0.05 + 0.95 * torch.rand(p.shape, generator=g)))


def _build(tmp_path_factory, name, config, seed, original_format=True):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    path = tmp_path_factory.mktemp(name)
    hf = fixtures.hf_model(
        path,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        config,
        seed=seed,
        original_format=original_format,
        rerandomize_params=rerandomize,
    )
    return path, hf


@pytest.fixture(scope="module")
def interval(tmp_path_factory):
    return _build(tmp_path_factory, "qwen3-next", INTERVAL, seed=51)


@pytest.fixture(scope="module")
def every_layer_moe(tmp_path_factory):
    """INTERVAL with MoE in every layer: llama.cpp's qwen3next has no dense MLP layers."""
    return _build(tmp_path_factory, "qwen3-next-moe", dict(INTERVAL, mlp_only_layers=[]), seed=53)


@pytest.fixture(scope="module")
def listed(tmp_path_factory):
    """transformers 5's fused expert banks, and the Hub's config spelling."""
    path, hf = _build(tmp_path_factory, "qwen3-next-listed", LISTED, 52, original_format=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(family.hub_spelling(config)))
    return path, hf


@pytest.mark.parametrize("layout", ["interval", "listed"])
def test_logits_and_greedy_tokens_match_transformers(layout, request):
    path, hf = request.getfixturevalue(layout)
    family.logits_match(path, hf)
    family.greedy_matches(path, hf)


def test_cached_decode_equals_uncached_forward(interval):
    family.cached_decode_matches(interval[0])


@pytest.mark.parametrize("layout", ["interval", "listed"])
def test_batched_sequences_match_single(layout, request):
    """Prefill chunks of 8 tokens carry each sequence's state across steps, beside other
    sequences' decode tokens."""
    family.batched_matches_single(*request.getfixturevalue(layout))


def test_every_policy_matches_resident(interval):
    family.policies_match_resident(interval[0], num_experts=8, moe_layers=3)


def test_fixed_shape_decode_matches_transformers(interval):
    family.fixed_shape_decode_matches(*interval)


def test_a_preempted_sequence_starts_again_from_zero_state(interval):
    """Too few KV pages for three sequences at once: some are preempted, their state slots
    given back, and recomputed later from zero state; every one still ends as alone."""
    path, hf = interval
    prompts = [family.PROMPT, family.PROMPT[:7], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3]
    engine = make_engine(path, chunk=8, page_size=4, pages=14)
    preempted = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq), preempt(seq))
    for p, s in zip(prompts, generate(engine, prompts, 16)):
        assert s.output_ids == fixtures.hf_greedy(hf, p, 16)
    assert preempted and engine.state.num_free == engine.state.num_slots


def test_an_embedding_in_chunks_carries_state_across_them(interval):
    from freetoken.runtime.embed import mean_hidden

    engine = make_engine(interval[0])
    whole = mean_hidden(engine, family.LONG, 1000)
    assert torch.allclose(mean_hidden(engine, family.LONG, 7), whole, atol=1e-5)
    assert engine.state.num_free == engine.state.num_slots


def test_structure_follows_the_config(interval, listed):
    path, _ = interval
    config = json.loads((path / "config.json").read_text())
    model = qwen3_next.Model.from_config(config)
    a = model.args
    assert a.layer_types == ("linear_attention", "full_attention") * 2
    assert a.rotary_dim == 8 and model.model.rotary.head_dim == 8
    layout = model.kv_layout()
    assert [lay.kind for lay in layout] == ["recurrent", "attention"] * 2
    assert layout[0].state == ((2 * 2 * 16 + 4 * 16, 3), (4, 16, 16))
    assert layout[1].heads == 2 and layout[1].k_dim == 32
    assert model.moe_layers == [0, 1, 3]
    assert qwen3_next.ModelArgs.from_dict(family.hub_spelling(config)) == a
    without = {k: v for k, v in config.items() if k != "layer_types"}
    assert qwen3_next.ModelArgs.from_dict({**without, "full_attention_interval": 2}) == a
    assert qwen3_next.Model.ignored("mtp.layers.0.mlp.gate.weight", config)
    assert qwen3_next.Model.dense_key("model.layers.0.mlp.shared_expert_gate.weight") == (
        "model.layers.0.mlp.shared_gate.weight"
    )
    info = qwen3_next.Model.model_info(config)
    assert info["qwen3next.full_attention_interval"] == 2
    assert info["qwen3next.ssm.inner_size"] == 64 and info["qwen3next.ssm.group_count"] == 2
    assert info["qwen3next.rope.dimension_count"] == 8
    listed_config = json.loads((listed[0] / "config.json").read_text())
    assert qwen3_next.Model.model_info(listed_config)["qwen3next.full_attention_interval"] == 0


def test_show_counts_the_checkpoints_parameters(interval, tmp_path):
    from freetoken.ftw.convert import convert

    path, hf = interval
    out = convert(path, tmp_path / "ftw")
    index = json.loads((out / "ftw.json").read_text())
    info = models.model_info(json.loads((out / "config.json").read_text()), index)
    assert info["general.architecture"] == "qwen3next"
    assert info["general.parameter_count"] == sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    active = info["general.parameter_count"] - experts + experts * 2 // 8
    assert info["general.active_parameter_count"] == active


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs(interval):
    family.gpu_matches(*interval)


@pytest.mark.gpu
def test_batching_on_a_gpu_mixes_decode_tokens_with_prefill_chunks(interval):
    """Prefill chunks of 8 tokens beside other sequences' decode tokens, with the fused
    kernels, and decode-only steps replayed from graphs: each sequence as alone."""
    path, hf = interval
    prompts = [family.PROMPT, family.PROMPT[:7], family.LONG]
    engine = make_engine(path, chunk=8, page_size=4, pages=128, device="cuda", graphs="capture")
    for p, s in zip(prompts, generate(engine, prompts, 16)):
        assert s.output_ids == fixtures.hf_greedy(hf, p, 16)


@pytest.mark.parametrize("legacy", [False, True], ids=["split", "fused"])
def test_gguf_import_matches_transformers(every_layer_moe, tmp_path, legacy):
    """llama.cpp's qwen3next file: its converter's −e^{A_log}, norms plus one, squeezed conv
    kernels and dt_proj bias undone; q/k/v/z split in two tensors, or (older files) whole."""
    path, hf = every_layer_moe
    family.gguf_matches(path, hf, tmp_path, "qwen3next", legacy=legacy)


def test_gguf_config_reads_the_layout_from_the_tensor_names(every_layer_moe, tmp_path):
    from freetoken.weights import gguf_file
    from tests.fixtures_gguf import write_gguf

    path, hf = every_layer_moe
    for legacy, layout in ((False, "split_qkvz"), (True, "grouped")):
        gguf = write_gguf(hf, path, tmp_path / f"{layout}.gguf", arch="qwen3next", legacy=legacy)
        reader = gguf_file._open(gguf)
        config = gguf_file.config_of(reader, gguf_file.metadata(reader))
        a = qwen3_next.ModelArgs.from_dict(config)
        assert a.linear_projections == layout and a.mlp_only_layers == ()
        assert a.layer_types == ("linear_attention", "full_attention") * 2
        assert (a.rotary_dim, a.linear_value_head_dim, a.linear_num_value_heads) == (8, 16, 4)
