"""gpt-oss against transformers on tiny random configs (fp32): sinks, sliding-window and full
layers (a window shorter than the prompts), q/k/v/o biases, a head dim other than
hidden/heads, YaRN (truncate off, a stretch the prompts reach), a router with a bias taking
the top 4 of 8, biased experts computing the clamped SwiGLU (alpha and a limit the
activations reach, read from the config), the checkpoint's interleaved whole-layer expert
banks, and llama.cpp's gpt-oss GGUF (gate and up split, each with its bias)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from freetoken.kernels import reference
from freetoken.models import gpt_oss
from tests import fixtures
from tests.models import family
from tests.runtime.engine_util import full_logits, generate, make_engine

ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}
CONFIG = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # not hidden / heads
    num_local_experts=8,
    num_experts_per_tok=4,
    sliding_window=5,
    swiglu_alpha=1.5,
    swiglu_limit=0.9,  # reached: the clamp changes the result
    max_position_embeddings=512,
    rope_parameters=ROPE,
)


def _build(tmp_path_factory, name, seed, gate_scale=1.0, **overrides):
    """gate_scale multiplies the experts' gate/up matrices: at the released clamp (7) the
    activations reach it only when they are that much larger."""
    from transformers import GptOssConfig, GptOssForCausalLM

    def rerandomize(model, seed):
        family.rerandomize_with_biases(model, seed)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj.mul_(gate_scale)

    path = tmp_path_factory.mktemp(name)
    hf = fixtures.hf_model(
        path,
        GptOssConfig,
        GptOssForCausalLM,
        {**CONFIG, **overrides},
        seed=seed,
        rerandomize_params=rerandomize,
    )
    return path, hf


# transformers before 5.18 fixes the clamp at the released values whatever the config says:
# there the model is built at those, its gate/up scaled so that the clamp is still reached
RELEASED_CLAMP = dict(gate_scale=6.0, swiglu_alpha=1.702, swiglu_limit=7.0)


def _clamp() -> dict:
    """The clamp to build the test models at: the config's own where transformers reads it."""
    from transformers import GptOssConfig

    return {} if "swiglu_limit" in GptOssConfig.__annotations__ else RELEASED_CLAMP


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return _build(tmp_path_factory, "gpt-oss", seed=61, **_clamp())


def test_logits_and_greedy_tokens_match_transformers(hub):
    family.logits_match(*hub)
    family.logits_match(*hub, prompt=family.LONG)  # past the window and YaRN's original length
    family.greedy_matches(*hub)


def test_cached_decode_equals_uncached_forward(hub):
    family.cached_decode_matches(hub[0])


def test_batched_sequences_match_single(hub):
    family.batched_matches_single(*hub)


def test_fixed_shape_decode_matches_transformers(hub):
    family.fixed_shape_decode_matches(*hub)


def test_every_policy_matches_resident(hub):
    family.policies_match_resident(hub[0], num_experts=8, moe_layers=3)


@pytest.mark.parametrize(
    "mode,device",
    [
        ("split", "cpu"),
        ("layers", "cpu"),
        pytest.param("split", "cuda", marks=pytest.mark.gpu),
        pytest.param("layers", "cuda", marks=pytest.mark.gpu),
    ],
)
def test_adaptive_through_the_lane_and_device_books(hub, mode, device):
    """Biased, clamped experts through the CPU lane (a share of each layer's misses, or
    whole CPU layers) with the cache's books on the device, in CUDA graphs on a GPU:
    transformers' tokens."""
    from freetoken.moe import chooser

    path, hf = hub
    engine = make_engine(
        path,
        policy="adaptive",
        slots={"split": 9, "layers": 8}[mode],
        device=device,
        device_cache="on",
        cpu_lane="on",
        graphs="capture" if device == "cuda" else "",
    )
    backend = family.experts_of(engine)
    backend.tuner.modes = chooser.ModeChooser(modes=(mode,))
    assert backend.lru is not None and backend.lane is not None
    try:
        for prompt in (family.PROMPT, family.LONG):
            (seq,) = generate(engine, [prompt], 16)
            assert seq.output_ids == fixtures.hf_greedy(hf, prompt, 16)
        assert backend.placement.mode == mode
        lane = backend.stats()["lane"]
        assert lane["served"] > 0 and lane["failed"] == 0 and lane["timeouts"] == 0
    finally:
        backend.lane.stop()


@pytest.fixture(scope="module")
def for_gguf(tmp_path_factory):
    """llama.cpp's files name no clamp (its own is the released models'): a model at those
    values, its gate/up scaled so that the clamp is reached."""
    return _build(tmp_path_factory, "gpt-oss-gguf", seed=63, **RELEASED_CLAMP)


def test_gguf_import_matches_transformers(for_gguf, tmp_path):
    family.gguf_matches(*for_gguf, tmp_path, "gpt-oss")


def _with_experts(hf, weights: dict[str, torch.Tensor]):
    """transformers' model with its experts' matrices replaced by a GGUF file's (by GGUF
    name, split gate and up): the exact reference for a file whose experts are rounded."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            gate, up = (weights[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up"))
            E, I, H = gate.shape
            interleaved = torch.stack((gate, up), dim=2).reshape(E, 2 * I, H)
            layer.mlp.experts.gate_up_proj.copy_(interleaved.transpose(1, 2))
            down = weights[f"blk.{i}.ffn_down_exps.weight"]
            layer.mlp.experts.down_proj.copy_(down.transpose(1, 2))
    return ref


@pytest.mark.parametrize("qtype", ["F16", "BF16", "MXFP4"])
def test_gguf_with_rounded_experts_loads_them_as_they_are(for_gguf, tmp_path, qtype):
    """Expert tensors in F16, BF16 or MXFP4 (llama.cpp's gpt-oss files are MXFP4, kept
    packed): the banks hold gguf's own values, biases included, and the logits are
    transformers' with those experts."""
    from freetoken.ftw.convert import convert
    from tests.fixtures_gguf import dequantized_state, write_gguf

    path, hf = for_gguf
    gguf = write_gguf(hf, path, tmp_path / "m.gguf", qtype, arch="gpt-oss")
    engine = make_engine(convert(gguf, tmp_path / "ftw"), dtype="float32")
    ref = dequantized_state(gguf)
    host = family.experts_of(engine).banks
    banks, fmt = host.banks[1], host.specs[1].format_of("down")
    halves = [ref[f"blk.1.ffn_{p}_exps.bias"] for p in ("gate", "up")]
    assert torch.equal(banks["gate_up_bias"], torch.cat(halves, 1))
    assert fmt == ("mxfp4" if qtype == "MXFP4" else "")  # kept packed
    down = reference.dequantize(banks["down"], fmt) if fmt else banks["down"].float()
    assert torch.equal(down, ref["blk.1.ffn_down_exps.weight"])
    want = fixtures.hf_logits(_with_experts(hf, ref), family.PROMPT)
    assert family.rel(full_logits(engine, family.PROMPT), want) <= 1e-4


def test_layer_types_from_the_config(tmp_path_factory):
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    path, hf = _build(tmp_path_factory, "gpt-oss-types", seed=62, layer_types=types, **_clamp())
    model = gpt_oss.Model.from_config(json.loads((path / "config.json").read_text()))
    assert [lay.window for lay in model.kv_layout()] == [0, 5, 5]
    family.logits_match(path, hf, prompt=family.LONG)


def test_structure_follows_the_config(hub):
    path, _ = hub
    config = json.loads((path / "config.json").read_text())
    model = gpt_oss.Model.from_config(config)
    assert [lay.window for lay in model.kv_layout()] == [5, 0, 5]
    assert model.moe_layers == [0, 1, 2]
    spec = model.expert_specs()[0]
    assert spec.bias and spec.activation == "swiglu_clamped"
    assert (spec.alpha, spec.limit) == (config["swiglu_alpha"], config["swiglu_limit"])
    s = model.args.rope_scaling
    assert (s.kind, s.factor, s.truncate) == ("yarn", 8.0, False)
    # the Hub's spelling: rope_theta and rope_scaling at the top level
    hub_cfg = family.hub_spelling(config, rope_scaling={**ROPE})
    assert gpt_oss.ModelArgs.from_dict(hub_cfg) == model.args
    # a config naming no rope settings gets the released models' YaRN, as in transformers
    bare = {k: v for k, v in config.items() if k != "rope_parameters"}
    assert gpt_oss.ModelArgs.from_dict(bare).rope_scaling.factor == 32.0
    info = gpt_oss.Model.model_info(config)
    assert info["general.architecture"] == "gpt-oss"
    assert info["gpt-oss.expert_feed_forward_length"] == 32
    assert info["gpt-oss.attention.sliding_window"] == 5
    assert info["gpt-oss.rope.scaling.factor"] == 8.0


def test_show_counts_the_converted_tensors(hub, tmp_path):
    """What `show` reports of a converted model: the model file's keys and the parameters
    the index counts, the experts' biases among the experts (a token uses 4 of 8)."""
    from freetoken import models
    from freetoken.ftw.convert import convert

    path, hf = hub
    out = convert(path, tmp_path / "ftw")
    config = json.loads((out / "config.json").read_text())
    info = models.model_info(config, json.loads((out / "ftw.json").read_text()))
    params = hf.state_dict()
    total = sum(t.numel() for t in params.values())
    experts = sum(t.numel() for n, t in params.items() if ".experts." in n)
    assert info["general.parameter_count"] == total
    assert info["general.active_parameter_count"] == total - experts // 2
    assert info["general.architecture"] == "gpt-oss" and info["gpt-oss.expert_count"] == 8
    assert models.arch_for(config).family == "gptoss"


def test_checkpoint_names():
    key = gpt_oss.Model.expert_key
    gu = key("model.layers.3.mlp.experts.gate_up_proj")
    assert (gu.layer, gu.bank, gu.transposed, gu.interleaved) == (3, "gate_up", True, True)
    gub = key("model.layers.3.mlp.experts.gate_up_proj_bias")
    assert (gub.bank, gub.transposed, gub.interleaved) == ("gate_up_bias", False, True)
    assert key("model.layers.3.mlp.experts.down_proj").transposed
    assert key("model.layers.3.mlp.experts.down_proj_bias").bank == "down_bias"
    assert key("model.layers.3.mlp.router.weight") is None
    assert (
        gpt_oss.Model.dense_key("model.layers.3.mlp.router.bias") == "model.layers.3.mlp.gate.bias"
    )
    blocks = key("model.layers.3.mlp.experts.gate_up_proj_blocks")  # [E, 2I, H/32, 16]
    assert (blocks.bank, blocks.transposed, blocks.interleaved) == ("gate_up", False, True)
    assert not key("model.layers.3.mlp.experts.down_proj_blocks").transposed
    gguf = gpt_oss.Model.gguf_key
    assert gguf("blk.2.ffn_up_exps.bias").bank == "gate_up_bias"
    assert gguf("blk.2.ffn_up_exps.bias").half == 1
    assert gguf("blk.2.ffn_gate_up_exps.weight").half is None
    assert gguf("blk.2.attn_sinks.weight") == "model.layers.2.self_attn.sinks"
    assert gguf("blk.2.ffn_gate_inp.bias") == "model.layers.2.mlp.gate.bias"


def test_gguf_metadata():
    kv = {
        "gpt-oss.embedding_length": 2880,
        "gpt-oss.block_count": 36,
        "gpt-oss.attention.head_count": 64,
        "gpt-oss.attention.head_count_kv": 8,
        "gpt-oss.attention.key_length": 64,
        "gpt-oss.feed_forward_length": 2880,
        "gpt-oss.expert_feed_forward_length": 2880,
        "gpt-oss.expert_count": 128,
        "gpt-oss.expert_used_count": 4,
        "gpt-oss.attention.sliding_window": 128,
        "gpt-oss.rope.freq_base": 150000.0,
        "gpt-oss.rope.scaling.type": "yarn",
        "gpt-oss.rope.scaling.factor": 32.0,
        "gpt-oss.rope.scaling.original_context_length": 4096,
    }
    config = gpt_oss.Model.config_from_gguf(kv, "gpt-oss")
    a = gpt_oss.ModelArgs.from_dict({**config, "vocab_size": 201088})
    assert a.layer_types[:3] == ("sliding_attention", "full_attention", "sliding_attention")
    assert (a.num_local_experts, a.num_experts_per_tok, a.intermediate_size) == (128, 4, 2880)
    assert (a.head_dim, a.sliding_window, a.rope_theta) == (64, 128, 150000.0)
    s = a.rope_scaling
    assert (s.kind, s.factor, s.original_max_position_embeddings) == ("yarn", 32.0, 4096)
    assert not s.truncate and (s.beta_fast, s.beta_slow) == (32.0, 1.0)


def test_router_matches_transformers_router():
    """The biased top-k router: the top 4 logits, softmaxed over those alone."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from freetoken.layers import fused
    from freetoken.layers.routers import TopKRouter

    g = torch.Generator().manual_seed(7)
    cfg = GptOssConfig(hidden_size=64, num_local_experts=16, num_experts_per_tok=4)
    ref = GptOssTopKRouter(cfg)
    ours = TopKRouter(64, 16, 4, True, bias=True)
    with torch.no_grad():
        ref.weight.copy_(torch.randn((16, 64), generator=g) / 8)
        ref.bias.copy_(torch.randn(16, generator=g))
    ours.load_state_dict(ref.state_dict())
    x = torch.randn((9, 64), generator=g)
    _, want_w, want_ids = ref(x)
    with fused.disabled():
        w, ids = ours(x)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(w, want_w, atol=1e-6)


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs(hub):
    family.gpu_matches(*hub)


def _hf_mxfp4_decoded(blocks: np.ndarray, scales: np.ndarray) -> torch.Tensor:
    """gpt-oss's MXFP4 layout decoded directly: weight 2b in byte b's low nibble, 2^(s-127)."""
    from freetoken.kernels.reference import E2M1

    b = torch.from_numpy(blocks)
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2).long()
    values = (
        torch.tensor(E2M1)[codes] * torch.exp2(torch.from_numpy(scales).float() - 127)[..., None]
    )
    return values.flatten(-2)


def test_mxfp4_checkpoint_keeps_its_blocks(for_gguf, tmp_path):
    """gpt-oss's released layout (`*_blocks`, `*_scales`): banks stay MXFP4 and the logits
    are transformers' with the experts those blocks decode to."""
    from safetensors.torch import load_file, save_file

    from freetoken.ftw.convert import convert
    from tests.fixtures_quant import mxfp4_hf

    path, hf = for_gguf
    src = tmp_path / "mxfp4"
    src.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (src / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (src / "config.json").write_text(json.dumps(config))
    tensors, ref = load_file(path / "model.safetensors"), copy.deepcopy(hf)
    for i, layer in enumerate(ref.model.layers):
        for part in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{part}"
            blocks, scales = mxfp4_hf(tensors.pop(name).transpose(1, 2).numpy())  # [E, out, in]
            tensors[name + "_blocks"] = torch.from_numpy(blocks)
            tensors[name + "_scales"] = torch.from_numpy(scales)
            with torch.no_grad():
                getattr(layer.mlp.experts, part).copy_(
                    _hf_mxfp4_decoded(blocks, scales).transpose(1, 2)
                )
    save_file(tensors, src / "model.safetensors")
    out = convert(src, tmp_path / "ftw")
    index = {t["name"]: t for t in json.loads((out / "ftw.json").read_text())["tensors"]}
    assert index["gate_up#L00002"]["quant"] == index["down#L00000"]["quant"] == "mxfp4"
    engine = make_engine(out, dtype="float32")
    want = fixtures.hf_logits(ref, family.PROMPT)
    assert family.rel(full_logits(engine, family.PROMPT), want) <= 1e-4
