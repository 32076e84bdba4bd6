"""DeepSeek-V4's own quantized names read by the checkpoint reader: an FP8 linear beside its
e8m0 block scales under `<module>.scale` comes out packed, its scales as fp32 multipliers."""

import json

import torch
from safetensors.torch import save_file

from freetoken import models
from freetoken.quant import pack
from freetoken.weights.safetensors_dir import Checkpoint

CONFIG = {
    "model_type": "deepseek_v4",
    "n_routed_experts": 2,
    "num_hidden_layers": 1,
    "quantization_config": {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "scale_fmt": "ue8m0",
    },
}


def test_an_fp8_linear_takes_its_e8m0_block_scales(tmp_path):
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(130, 256, generator=g) * 10).to(torch.float8_e4m3fn)
    bits = torch.randint(120, 130, (2, 2), generator=g, dtype=torch.uint8)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    tensors = {
        "layers.0.attn.wq_a.weight": w,
        "layers.0.attn.wq_a.scale": bits.view(torch.float8_e8m0fnu),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    files = {p.name: p for p in tmp_path.iterdir()}
    with Checkpoint(files, models.load_class(CONFIG)) as ck:
        ((name, t, fmt),) = list(ck.dense_items())
    assert (name, fmt) == ("model.layers.0.self_attn.q_a_proj.weight", "fp8_e4m3")
    assert torch.equal(t, pack.fp8_rows(w, torch.exp2(bits.float() - 127)))
