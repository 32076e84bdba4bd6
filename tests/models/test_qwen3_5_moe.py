"""Qwen3.5-MoE's language model against transformers on tiny random configs (fp32): the
multimodal checkpoint (text_config, tensors under model.language_model., a vision tower
that is ignored) against transformers' whole model on text, and the language model alone;
DeltaNet layers with split input projections, gated attention with multimodal rotary
(plain rotary for text), every layer MoE with a sigmoid-gated shared expert."""

from __future__ import annotations

import json

import pytest

from freetoken import models
from freetoken.models import qwen3_5_moe
from tests import fixtures
from tests.models import family
from tests.models.test_qwen3_next import rerandomize

pytest.importorskip("transformers")

TEXT = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=8,
    num_experts_per_tok=2,
    full_attention_interval=2,
    max_position_embeddings=512,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    bos_token_id=None,
    eos_token_id=None,
)
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    out_hidden_size=64,
    num_position_embeddings=16,
)
# the language model alone: attention first, a value head per key head
TEXT_ONLY = dict(
    TEXT,
    num_hidden_layers=3,
    layer_types=["full_attention", "linear_attention", "linear_attention"],
    linear_num_value_heads=2,
)


def multimodal_config(vocab_size: int, **_):
    from transformers import Qwen3_5MoeConfig

    return Qwen3_5MoeConfig(text_config={**TEXT, "vocab_size": vocab_size}, vision_config=VISION)


def _build(tmp_path_factory, name, seed, multimodal=True, text=TEXT_ONLY):
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    path = tmp_path_factory.mktemp(name)
    if multimodal:
        cls, config, settings = m.Qwen3_5MoeForConditionalGeneration, multimodal_config, {}
    else:
        cls, config, settings = m.Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, text
    hf = fixtures.hf_model(
        path,
        config,
        cls,
        settings,
        seed=seed,
        original_format=multimodal,
        rerandomize_params=rerandomize,
    )
    return path, hf


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    return _build(tmp_path_factory, "qwen3.5-moe", seed=61)


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    """transformers 5's fused expert banks."""
    return _build(tmp_path_factory, "qwen3.5-moe-text", seed=62, multimodal=False)


@pytest.fixture(scope="module")
def text_interval(tmp_path_factory):
    """The language model alone, two value heads per key head, attention every other layer
    (a layer pattern GGUF metadata can say)."""
    return _build(tmp_path_factory, "qwen3.5-moe-interval", seed=63, multimodal=False, text=TEXT)


@pytest.mark.parametrize("layout", ["multimodal", "text_only"])
def test_logits_and_greedy_tokens_match_transformers(layout, request):
    path, hf = request.getfixturevalue(layout)
    family.logits_match(path, hf)
    family.greedy_matches(path, hf)


def test_cached_decode_equals_uncached_forward(multimodal):
    family.cached_decode_matches(multimodal[0])


def test_batched_sequences_match_single(multimodal):
    family.batched_matches_single(*multimodal)


def test_every_policy_matches_resident(text_only):
    family.policies_match_resident(text_only[0], num_experts=8, moe_layers=3)


def test_fixed_shape_decode_matches_transformers(multimodal):
    family.fixed_shape_decode_matches(*multimodal)


def test_the_vision_tower_and_mtp_weights_are_ignored(multimodal, tmp_path):
    """The converted model holds the language model's tensors alone; show counts them."""
    from freetoken.ftw.convert import convert

    path, hf = multimodal
    config = json.loads((path / "config.json").read_text())
    assert qwen3_5_moe.Model.ignored("model.visual.blocks.0.attn.qkv.weight", config)
    assert qwen3_5_moe.Model.ignored("mtp.fc.weight", config)
    assert not qwen3_5_moe.Model.ignored("model.language_model.norm.weight", config)
    name = "model.language_model.layers.1.mlp.experts.3.up_proj.weight"
    assert qwen3_5_moe.Model.expert_key(name).expert == 3
    out = convert(path, tmp_path / "ftw")
    index = json.loads((out / "ftw.json").read_text())
    info = models.model_info(json.loads((out / "config.json").read_text()), index)
    text = {n: p for n, p in hf.named_parameters() if ".visual." not in n}
    assert info["general.parameter_count"] == sum(p.numel() for p in text.values())
    assert info["general.architecture"] == "qwen35moe"
    assert info["qwen35moe.expert_count"] == 8 and info["qwen35moe.block_count"] == 4
    assert info["qwen35moe.ssm.time_step_rank"] == 4


def test_structure_follows_the_config(multimodal, text_only):
    for path, _ in (multimodal, text_only):
        config = json.loads((path / "config.json").read_text())
        model = models.load_class(config).from_config(config)
        assert type(model) is qwen3_5_moe.Model
        assert model.moe_layers == list(range(model.args.num_hidden_layers))
        linear = model.model.layers[1 if path == text_only[0] else 0].linear_attn
        assert linear.projections == "split"


def test_gguf_import_matches_transformers(text_interval, tmp_path):
    """llama.cpp's qwen35moe file: the value heads it tiled put back in the Hub's order (rows
    of q/k/v, z, b, a, A_log, dt_bias and the conv kernel, the output projection's columns),
    besides what its Qwen3-Next converter does."""
    path, hf = text_interval
    family.gguf_matches(path, hf, tmp_path, "qwen35moe")


def test_a_qwen3_next_in_a_qwen35moe_file_is_read_as_qwen3_next(tmp_path_factory, tmp_path):
    """Ollama converts Qwen3-Next to its qwen35moe architecture, b and a kept grouped
    (ssm_ba) and the value heads in the Hub's order."""
    from tests.models import test_qwen3_next

    path, hf = test_qwen3_next._build(
        tmp_path_factory, "next-as-35", dict(test_qwen3_next.INTERVAL, mlp_only_layers=[]), 54
    )
    family.gguf_matches(path, hf, tmp_path, "qwen35moe")


# wide enough that the projections are packed (rows of 256), two value heads per key head
PACKED = dict(
    TEXT,
    hidden_size=256,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    head_dim=64,
    linear_key_head_dim=32,
    linear_value_head_dim=64,
)


def test_a_packed_gguf_matches_transformers_on_its_decoded_weights(tmp_path_factory, tmp_path):
    """Q8_0 (the value heads' rows moved packed; the output projection decoded, then its
    columns moved) against transformers on the file's weights as gguf decodes them, put back
    in the Hub's layout by the test's own inverse of the converter."""
    from freetoken.ftw.convert import convert
    from tests.fixtures_gguf import write_gguf
    from tests.runtime.engine_util import full_logits, generate, make_engine

    path, hf = _build(tmp_path_factory, "qwen3.5-packed", 64, multimodal=False, text=PACKED)
    gguf = write_gguf(hf, path, tmp_path / "m.gguf", "Q8_0", arch="qwen35moe")
    engine = make_engine(convert(gguf, tmp_path / "ftw"), dtype="float32")
    assert engine.model.args.linear_num_value_heads == 4
    ref = _decoded_reference(hf, gguf)
    (seq,) = generate(engine, [family.PROMPT], 16)
    assert seq.output_ids == fixtures.hf_greedy(ref, family.PROMPT, 16)
    # the CPU kernels' int8 activations apart (measured 0.006), the logits are the reference's
    got = full_logits(engine, family.PROMPT)
    assert family.rel(got, fixtures.hf_logits(ref, family.PROMPT)) <= 0.02


def _decoded_reference(hf, gguf):
    """A copy of `hf` holding the GGUF's weights as gguf decodes them, with the converter's
    changes undone here: value heads from tiled to grouped, A = −e^{A_log}, norms less one,
    the conv kernel's middle axis."""
    import copy

    import gguf as gg
    import torch

    from tests.fixtures_gguf import dequantized_state

    c = hf.config
    state = dequantized_state(gguf)
    names = gg.get_tensor_name_map(gg.MODEL_ARCH.QWEN35MOE, c.num_hidden_layers)
    hk, r = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    dv, qk = c.linear_value_head_dim, 2 * c.linear_num_key_heads * c.linear_key_head_dim

    def grouped(t, dim, width):
        shape = t.shape
        return t.reshape(*shape[:dim], r, hk, width, *shape[dim + 1 :]).transpose(dim, dim + 1)

    def of(name):
        hf_name = name.replace(".dt_bias", ".dt_proj.bias")
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj")
            gate, up = (
                state[names.get_name(f"{base}.{p}_proj") + ".weight"] for p in ("gate", "up")
            )
            return torch.cat([gate, up], 1)
        if name.endswith("experts.down_proj"):
            return state[names.get_name(name) + ".weight"]
        t = state[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))]
        part = name.split(".linear_attn.")[-1]
        if part in ("in_proj_qkv.weight", "conv1d.weight"):
            t = torch.cat([t[:qk], grouped(t[qk:], 0, dv).reshape(t[qk:].shape)])
        elif part == "in_proj_z.weight":
            t = grouped(t, 0, dv).reshape(t.shape)
        elif part in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
            t = grouped(t, 0, 1).reshape(t.shape)
        elif part == "out_proj.weight":
            t = grouped(t, 1, dv).reshape(t.shape)
        if name.endswith("A_log"):
            return torch.log(-t)
        if name.endswith("norm.weight") and ".linear_attn." not in name:
            return t - 1
        return t

    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, t in ref.state_dict().items():
            t.copy_(of(name).reshape(t.shape))
    return ref


@pytest.mark.parametrize("packed", [False, True])
def test_untiling_moves_packed_rows_whole(packed):
    """Rows of a packed tensor move as the decoded rows do; the output projection, whose
    columns move, is asked for decoded."""
    import torch

    from freetoken.kernels.reference import dequantize
    from freetoken.quant.quantize import quantize

    config = dict(TEXT, num_hidden_layers=2, vocab_size=10, linear_value_head_dim=64)
    config |= {qwen3_5_moe.TILED: True}
    a = qwen3_5_moe.ModelArgs.from_dict(config)
    z = torch.randn(4 * 64, 256)
    key = "model.layers.0.linear_attn.in_proj_z.weight"
    plain, _ = qwen3_5_moe.Model.gguf_tensor(key, z, None, config)
    if packed:
        q, fmt = qwen3_5_moe.Model.gguf_tensor(key, quantize(z, "q8_0"), "q8_0", config)
        assert fmt == "q8_0"
        assert torch.equal(
            dequantize(q, fmt),
            qwen3_5_moe._grouped(dequantize(quantize(z, "q8_0"), "q8_0"), 0, 2, 2, 64),
        )
    assert torch.equal(plain, z.reshape(2, 2, 64, 256).transpose(0, 1).reshape(256, 256))
    assert a.linear_value_head_dim == 64
    assert qwen3_5_moe.Model.gguf_float("model.layers.0.linear_attn.out_proj.weight", config)
    assert not qwen3_5_moe.Model.gguf_float(key, config)


# A chat template in the form of these models' own (a test's, not the checkpoints'): tools
# listed as JSON, calls in Qwen3-Coder's XML form, the answer opened inside <think>.
TEMPLATE = """
{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a tool as <tool_call><function=NAME><parameter=ARG>VALUE</parameter></function></tool_call>
<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for call in m.tool_calls %}
<tool_call>
<function={{ call.function.name }}>
{%- for k, v in call.function.arguments.items() %}
<parameter={{ k }}>
{{ v }}
</parameter>
{%- endfor %}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}
{%- endif %}"""


def test_chat_format_renders_tools_and_parses_thinking_and_xml_calls():
    from freetoken.chat import template
    from freetoken.chat.formats import ParseOptions, QwenFormat

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny"},
    ]
    prompt = template.render(TEMPLATE, messages, tools=tools, think=True)
    assert '"name": "get_weather"' in prompt and "<parameter=city>\nParis\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert set(template.capabilities(TEMPLATE)) >= {"tools", "thinking"}
    parser = QwenFormat.from_template(TEMPLATE).parser(ParseOptions(tools=True, prompt=prompt))
    out = "It is sunny.\n</think>\n\nLet me check tomorrow.\n<tool_call>\n<function=get_weather>"
    out += "\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>"
    out += "\n</function>\n</tool_call>"
    events = parser.feed(out) + parser.finish()
    thinking = "".join(e.get("thinking", "") for e in events)
    content = "".join(e.get("content", "") for e in events)
    calls = [c for e in events for c in e.get("tool_calls", [])]
    assert thinking.strip() == "It is sunny." and content.strip() == "Let me check tomorrow."
    assert calls == [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    ]


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs(multimodal):
    family.gpu_matches(*multimodal)
