"""Qwen3-VL-MoE's language model against transformers on tiny random configs (fp32): the
multimodal checkpoint (text_config, tensors under model.language_model., transposed
expert banks, a vision tower that is ignored) against transformers' whole model on text;
multimodal rotary (plain rotary for text), and llama.cpp's qwen3vlmoe GGUF (whose
architecture has MoE layers only, as the released models do)."""

from __future__ import annotations

import json

import pytest

from freetoken import models
from freetoken.models import qwen3_vl_moe
from tests import fixtures
from tests.models import family

pytest.importorskip("transformers")

TEXT = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5e5,
        "mrope_section": [8, 4, 4],
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
    deepstack_visual_indexes=[0],
)


def multimodal_config(vocab_size: int, **_):
    from transformers import Qwen3VLMoeConfig

    return Qwen3VLMoeConfig(text_config={**TEXT, "vocab_size": vocab_size}, vision_config=VISION)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    from transformers import Qwen3VLMoeForConditionalGeneration

    path = tmp_path_factory.mktemp("qwen3-vl-moe")
    hf = fixtures.hf_model(path, multimodal_config, Qwen3VLMoeForConditionalGeneration, {}, seed=71)
    _as_the_hub_stores_them(path)
    return path, hf


def _as_the_hub_stores_them(path):
    """The Hub's checkpoints keep each expert bank transposed (gate_up [E, H, 2I], down
    [E, I, H]), which transformers transposes as it loads; its save writes its own layout."""
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[name] = t.transpose(1, 2).contiguous()
        save_file(tensors, f, metadata={"format": "pt"})


def test_logits_and_greedy_tokens_match_transformers(multimodal):
    family.logits_match(*multimodal)
    family.greedy_matches(*multimodal)


def test_cached_decode_equals_uncached_forward(multimodal):
    family.cached_decode_matches(multimodal[0])


def test_every_policy_matches_resident(multimodal):
    family.policies_match_resident(multimodal[0], num_experts=8, moe_layers=3)


def test_the_checkpoint_s_layout_and_what_is_ignored(multimodal, tmp_path):
    from freetoken.ftw.convert import convert

    path, hf = multimodal
    config = json.loads((path / "config.json").read_text())
    assert qwen3_vl_moe.Model.ignored("model.visual.blocks.0.attn.qkv.weight", config)
    assert not qwen3_vl_moe.Model.ignored("model.language_model.norm.weight", config)
    key = qwen3_vl_moe.Model.expert_key("model.language_model.layers.2.mlp.experts.down_proj")
    assert (key.layer, key.bank, key.transposed) == (2, "down", True)
    model = models.load_class(config).from_config(config)
    assert model.moe_layers == [0, 1, 2] and model.args.norm_topk_prob
    out = convert(path, tmp_path / "ftw")
    index = json.loads((out / "ftw.json").read_text())
    info = models.model_info(json.loads((out / "config.json").read_text()), index)
    text = {n: p for n, p in hf.named_parameters() if ".visual." not in n}
    assert info["general.parameter_count"] == sum(p.numel() for p in text.values())
    assert info["general.architecture"] == "qwen3vlmoe"
    assert info["qwen3vlmoe.expert_count"] == 8 and info["qwen3vlmoe.block_count"] == 3


def test_gguf_import_matches_transformers(multimodal, tmp_path):
    family.gguf_matches(*multimodal, tmp_path, "qwen3vlmoe")


def test_ollama_s_file_with_the_vision_tower_inside_reads_its_language_model(multimodal, tmp_path):
    """Ollama's qwen3vlmoe file holds the vision tower too (`v.*` tensors, `vision.*`
    keys): they are left out."""
    import numpy as np

    from freetoken.ftw.convert import convert
    from tests.fixtures_gguf import write_gguf
    from tests.runtime.engine_util import full_logits, make_engine

    path, hf = multimodal
    vision = {
        "v.blk.0.attn_qkv.weight": np.ones((96, 32), np.float32),
        "v.patch_embed.weight": np.ones((32, 48), np.float32),
        "v.deepstack_merger.0.norm.weight": np.ones(32, np.float32),
    }
    gguf = write_gguf(hf, path, tmp_path / "m.gguf", "F32", arch="qwen3vlmoe", extra=vision)
    engine = make_engine(convert(gguf, tmp_path / "ftw"))
    got = full_logits(engine, family.PROMPT)
    assert family.rel(got, fixtures.hf_logits(hf, family.PROMPT)) <= 1e-4
