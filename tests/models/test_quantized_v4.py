"""DeepSeek-V4's experts (SwiGLU of clamped inputs, models/base.py's silu_clamped) quantized
by `create --quantize q8_0`, and as DeepSeek ships them (FP4: e2m1 codes with an e8m0 scale
a 32 weights, under the Hub's names): the packed model continues text as transformers does
on the weights its blocks decode to, and gives the resident model's results under every
expert policy. The limit is lowered so that the clamp is reached: a kernel that skipped it
would give other tokens."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken.ftw import reader
from freetoken.ftw.convert import convert
from freetoken.kernels import reference
from freetoken.kernels.reference import dequantize
from freetoken.weights import WeightsError
from tests import fixtures
from tests.models import family, v4
from tests.models.test_deepseek_v4 import HUB, MIXED
from tests.runtime.engine_util import files_of, generate, make_engine


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds4")
    hf = v4.build(path, dict(MIXED, swiglu_limit=1.0), seed=31, original_format=False)
    out = convert(path, tmp_path_factory.mktemp("ftw") / "m", quantize="q8_0")
    return out, _decoded(hf, out)


def _decoded(hf, out):
    """The transformers model with each expert bank replaced by what its blocks decode to."""
    ref = copy.deepcopy(hf)
    w = reader.read(files_of(out), pin=False)
    with torch.no_grad():
        for (layer, bank), t in w.banks.items():
            experts = ref.model.layers[layer].mlp.experts
            param = {"gate_up": experts.gate_up_proj, "down": experts.down_proj}[bank]
            param.copy_(dequantize(t, w.formats[(layer, bank)]).float())
    return ref


def test_every_bank_is_packed(quantized):
    out, _ = quantized
    index = json.loads((out / "ftw.json").read_text())
    banks = [t for t in index["tensors"] if t["kind"] == "bank"]
    assert len(banks) == 8 and {t.get("quant") for t in banks} == {"q8_0"}
    assert index["quantize"] == "q8_0"


def test_greedy_tokens_are_transformers_on_the_decoded_weights(quantized):
    out, ref = quantized
    (seq,) = generate(make_engine(out, dtype="float32"), [family.PROMPT], 16)
    assert seq.output_ids == fixtures.hf_greedy(ref, family.PROMPT, 16)


def test_every_policy_matches_resident(quantized):
    out, ref = quantized
    family.policies_match_resident(out, ref.config.n_routed_experts, 4, dtype="float32")


def _e2m1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (nearest e2m1 value) and e8m0 exponent bytes of each 32 weights, the exponent
    the smallest whose largest code (6) covers the group's largest magnitude."""
    g = w.float().reshape(*w.shape[:-1], -1, 32)
    e = torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True).clamp_min(2**-60) / 6))
    grid = torch.tensor(reference.E2M1)
    codes = (g / torch.exp2(e))[..., None].sub(grid).abs().argmin(-1).to(torch.uint8)
    return codes.reshape(w.shape), (e + 127).to(torch.uint8).squeeze(-1)


def _as_shipped(path, drop: str | None = None) -> None:
    """The Hub-spelled checkpoint at `path` with its routed experts in DeepSeek's FP4 (and
    the quantization its config.json declares); `drop` names a scale left out."""
    file = path / "model.safetensors"
    weights = load_file(str(file))
    for name in [n for n in weights if ".ffn.experts." in n]:
        codes, bits = _e2m1(weights[name])
        packed = codes[..., 0::2] | codes[..., 1::2] << 4
        weights[name] = packed.view(torch.float4_e2m1fn_x2)
        weights[name.removesuffix(".weight") + ".scale"] = bits.view(torch.float8_e8m0fnu)
    weights.pop(drop, None)
    save_file(weights, str(file))
    config = json.loads((path / "config.json").read_text())
    config["expert_dtype"] = "fp4"
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds4-fp4")
    hf = v4.build(path, dict(HUB, swiglu_limit=1.0), seed=33)
    v4.hub_spelling(path, hf)
    _as_shipped(path)
    out = convert(path, tmp_path_factory.mktemp("ftw-fp4") / "m")
    return out, _decoded(hf, out)


def test_fp4_experts_stay_packed_as_mxfp4(shipped):
    out, _ = shipped
    index = json.loads((out / "ftw.json").read_text())
    banks = [t for t in index["tensors"] if t["kind"] == "bank"]
    assert len(banks) == 6 and {t.get("quant") for t in banks} == {"mxfp4"}
    dense = [t for t in index["tensors"] if t["kind"] == "dense"]
    assert not any(t.get("quant") or ".experts." in t["name"] for t in dense)


def test_fp4_greedy_tokens_are_transformers_on_the_decoded_weights(shipped):
    out, ref = shipped
    (seq,) = generate(make_engine(out, dtype="float32"), [family.PROMPT], 16)
    assert seq.output_ids == fixtures.hf_greedy(ref, family.PROMPT, 16)


def test_fp4_every_policy_matches_resident(shipped):
    out, ref = shipped
    family.policies_match_resident(out, ref.config.n_routed_experts, 4, dtype="float32")


def test_an_fp4_expert_without_its_scale_is_refused_by_name(tmp_path):
    path = tmp_path / "src"
    hf = v4.build(path, HUB, seed=34)
    v4.hub_spelling(path, hf)
    missing = "layers.2.ffn.experts.3.w2.scale"
    _as_shipped(path, drop=missing)
    with pytest.raises(WeightsError, match=missing.replace(".", r"\.")):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
