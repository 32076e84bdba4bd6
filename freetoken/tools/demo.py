"""Writes the demo model: a small random-weight Qwen3-MoE and a Modelfile for it.

    python -m freetoken.tools.demo OUT_DIR

Random weights produce gibberish; the demo shows the whole path (create, serve, stream)
working, not a useful model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from freetoken.tools import synth

DEMO_SHAPE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=16,
                  num_experts_per_tok=4)

MODELFILE = '''# The FreeToken demo: a small random-weight Qwen3-MoE (it answers in gibberish).
FROM ./weights
PARAMETER temperature 0.7
PARAMETER num_ctx 2048
PARAMETER num_predict 64
PARAMETER stop "<|im_end|>"
SYSTEM """You are a helpful assistant."""
'''


def write_demo(out: Path, seed: int = 0) -> Path:
    weights = out / "weights"
    if not (weights / "model.safetensors").exists():
        synth.write_qwen3_moe(weights, seed=seed, vocab_size=2048, **DEMO_SHAPE)
    (out / "Modelfile").write_text(MODELFILE)
    return out / "Modelfile"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_demo(args.out, args.seed))


if __name__ == "__main__":
    main()
