"""The demo trainer: its network is Qwen3-MoE as transformers computes it (on the files it
writes), training lowers the loss, and the corpus is chat turns in the demo's template."""

from __future__ import annotations

import torch

from freetoken.tools import demo, synth, train_demo
from tests import fixtures

SHAPE = dict(demo.DEMO_SHAPE, hidden_size=64, num_hidden_layers=2, num_experts=8)


def _config(vocab: int) -> dict:
    return synth.qwen3_moe_config(vocab, **SHAPE)


def test_the_written_model_is_transformers_qwen3_moe(tmp_path):
    """Weights re-randomised (norms too, so every one is checked), written in fp32 and read
    by transformers: the same logits as the trainer's forward."""
    from transformers import AutoModelForCausalLM

    tok = synth.train_tokenizer(300)
    torch.manual_seed(1)
    model = train_demo.DemoLM(_config(tok.get_vocab_size())).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn_like(p) / p.shape[-1] ** 0.5
                if p.dim() > 1
                else 1 + 0.1 * torch.randn_like(p)
            )
    out = train_demo.write(tmp_path / "m", model, tok, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tok.encode("<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n").ids
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0]
    ref = fixtures.hf_logits(hf, ids)
    assert float((ours - ref).norm() / ref.norm()) <= 1e-4


def test_training_lowers_the_loss():
    tok = synth.train_tokenizer(300)
    text = "".join(train_demo.conversations()[:20])
    ids = tok.encode(text).ids
    config = _config(tok.get_vocab_size())
    batch = torch.tensor([ids[:65], ids[100:165]])

    def loss(model) -> float:
        with torch.no_grad():
            logits, _ = model(batch[:, :-1])
        return float(
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        )

    torch.manual_seed(0)  # train() starts from the same weights
    before = loss(train_demo.DemoLM(config))
    # by steps, not seconds: on a busy machine four seconds once left it 0.4 short
    trained = train_demo.train(config, ids, 0.0, seq=64, batch=8, log=lambda _: None, steps=150)
    after = loss(trained)
    assert after < before - 1.0


def test_the_corpus_is_chat_turns_that_end():
    texts = train_demo.conversations()
    assert len(texts) > 500
    for t in texts[:50]:
        assert t.startswith("<|im_start|>system\n") and t.endswith("<|im_end|>\n")
        assert "<|im_start|>assistant\n" in t and t.count("<|im_end|>") == 3


def test_the_demo_ships_trained_weights_when_given(tmp_path):
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "model.safetensors").write_bytes(b"weights")
    modelfile = demo.write_demo(tmp_path / "demo", trained=trained)
    assert (modelfile.parent / "weights" / "model.safetensors").read_bytes() == b"weights"
    assert "trained on Python's documentation" in modelfile.read_text()
