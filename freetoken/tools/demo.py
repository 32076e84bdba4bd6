"""The demo model: a small random-weight Qwen3-MoE, and a Modelfile for it.

    python -m freetoken.tools.demo OUT_DIR

Random weights produce gibberish; the demo shows the whole path (pull or create, serve,
stream) working, not a useful model. The same model, pushed into freetoken/registry/embedded,
is what the Quick start pulls.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from freetoken.tools import synth

DEMO_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=4,
)
SYSTEM = "You are a helpful assistant."
PARAMETERS = {"temperature": 0.7, "num_ctx": 2048, "num_predict": 64, "stop": ["<|im_end|>"]}


def modelfile_text(source: str) -> str:
    lines = [
        "# The FreeToken demo: a small random-weight Qwen3-MoE (it answers in gibberish).",
        f"FROM {source}",
    ]
    for key, value in PARAMETERS.items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"PARAMETER {key} {json.dumps(v) if isinstance(v, str) else v}")
    lines.append(f'SYSTEM """{SYSTEM}"""')
    return "\n".join(lines) + "\n"


def write_demo(out: Path, seed: int = 0) -> Path:
    """Writes OUT/weights (a Hugging Face directory) and OUT/Modelfile; returns the Modelfile."""
    weights = out / "weights"
    if not (weights / "model.safetensors").exists():
        synth.write_qwen3_moe(weights, seed=seed, vocab_size=2048, dtype="bfloat16", **DEMO_SHAPE)
    (out / "Modelfile").write_text(modelfile_text("./weights"))
    return out / "Modelfile"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_demo(args.out, args.seed))


if __name__ == "__main__":
    main()
