"""The demo model: a small Qwen3-MoE, and a Modelfile for it.

    python -m freetoken.tools.demo OUT_DIR [--weights TRAINED_DIR]

With `--weights`, the model freetoken.tools.train_demo trained on Python's documentation
(it answers in words); without, the same shape with random weights (it answers in
gibberish: what tests and benchmarks use). The model pushed into
freetoken/registry/embedded is what the Quick start pulls.
"""

from __future__ import annotations

import argparse
import json
import shutil
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
VOCAB_SIZE = 2048
SYSTEM = "You are a helpful assistant."
PARAMETERS = {"temperature": 0.7, "num_ctx": 2048, "num_predict": 64, "stop": ["<|im_end|>"]}


def modelfile_text(source: str, trained: bool = False) -> str:
    what = (
        "trained on Python's documentation (it answers in words, not always right ones)"
        if trained
        else "with random weights (it answers in gibberish)"
    )
    lines = [f"# The FreeToken demo: a small Qwen3-MoE {what}.", f"FROM {source}"]
    for key, value in PARAMETERS.items():
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"PARAMETER {key} {json.dumps(v) if isinstance(v, str) else v}")
    lines.append(f'SYSTEM """{SYSTEM}"""')
    return "\n".join(lines) + "\n"


def write_demo(out: Path, seed: int = 0, trained: Path | None = None) -> Path:
    """Writes OUT/weights (a Hugging Face directory: a copy of `trained`, else random
    weights) and OUT/Modelfile; returns the Modelfile."""
    weights = out / "weights"
    if trained is not None:
        shutil.copytree(trained, weights, dirs_exist_ok=True)
    elif not (weights / "model.safetensors").exists():
        synth.write_qwen3_moe(
            weights, seed=seed, vocab_size=VOCAB_SIZE, dtype="bfloat16", **DEMO_SHAPE
        )
    (out / "Modelfile").write_text(modelfile_text("./weights", trained is not None))
    return out / "Modelfile"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", type=Path, help="a trained model's directory (train_demo)")
    args = ap.parse_args()
    print(write_demo(args.out, args.seed, args.weights))


if __name__ == "__main__":
    main()
