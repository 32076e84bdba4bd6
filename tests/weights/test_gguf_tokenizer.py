"""The tokenizer rebuilt from a GGUF's metadata tokenizes as the checkpoint's own
tokenizer.json does: the same ids for the same prompts (no BOS where the GGUF says
add_bos_token = false, added tokens matched whole, the text normalized alike) and the same
text back from the same ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from freetoken.runtime.tokenizer import Tokenizer
from freetoken.tools import synth
from freetoken.weights.gguf_tokenizer import write_tokenizer_files

# Qwen2/Qwen3's split, as their tokenizer.json writes it
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PROMPTS = [
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "Hello! How are you?   Numbers 12345 and 3.14159, naïve café (cafe\u0301), 日本語 🙂",
    "  leading spaces\n\n\ttabs\r\nand windows newlines'll we've",
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><|endoftext|>',
    "<|im_start|>system\n<|im_start|> nested <|im_end|> markers<|im_end|>",
]


def write_qwen_like(out: Path) -> Path:
    """A tokenizer.json laid out as Qwen3's: NFC normalizer, the Qwen2 split then byte-level
    BPE, control tokens special and markup tokens added but not special."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    tok = synth.train_tokenizer(512)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def write_gguf_tokenizer(hf: Path, out: Path, bos: str | None) -> Path:
    """The tokenizer keys llama.cpp's converter writes for a Qwen checkpoint: the vocabulary
    in id order, CONTROL (3) for special added tokens, USER_DEFINED (4) for the other added
    tokens, the merges, `qwen2` as the split, BOS named or not, add_bos_token false."""
    import gguf

    tj = json.loads((hf / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    types = {}
    for added in tj["added_tokens"]:
        vocab[added["content"]] = added["id"]
        types[added["content"]] = 3 if added["special"] else 4
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([types.get(t, 1) for t in tokens])
    merges = tj["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(vocab["<|im_end|>"])
    if bos is not None:
        w.add_bos_token_id(vocab[bos])
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def tokenizer(d: Path) -> Tokenizer:
    return Tokenizer({p.name: p for p in d.iterdir()})


@pytest.mark.parametrize("bos", [None, "<|endoftext|>"], ids=["no BOS named", "BOS named"])
def test_the_rebuilt_tokenizer_gives_the_same_ids_and_text(tmp_path, bos):
    hf = write_qwen_like(tmp_path / "hf")
    rebuilt = tmp_path / "gguf"
    write_tokenizer_files(write_gguf_tokenizer(hf, tmp_path / "m.gguf", bos), rebuilt)
    want, got = tokenizer(hf), tokenizer(rebuilt)
    assert got.add_bos is False
    for prompt in PROMPTS:
        ids = want.encode(prompt)
        assert got.encode(prompt) == ids, prompt
        assert got.decode(ids) == want.decode(ids), prompt
    # markup tokens are text a parser reads; control tokens are not
    ids = want.encode(PROMPTS[0])
    assert "<think>" in got.decode(ids) and "<|im_start|>" not in got.decode(ids)


def test_a_gguf_and_its_directory_answer_alike(tmp_path):
    """The issue's case end to end: one model created from its Hugging Face directory and
    from a GGUF of it (add_bos_token false) counts the same prompt tokens and gives the same
    greedy answer through the API."""
    import ollama

    from freetoken.store import CreateSpec, Store
    from tests import fixtures
    from tests.fixtures_gguf import write_gguf
    from tests.pull.conftest import make_cfg
    from tests.server.harness import LiveServer

    hf = tmp_path / "hf"
    model = fixtures.hf_qwen3_moe(hf, seed=3)
    template = json.loads((hf / "tokenizer_config.json").read_text())["chat_template"]
    write_qwen_like(hf)  # the same vocabulary, laid out as Qwen's tokenizer.json
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    gguf = write_gguf(model, hf, tmp_path / "m.gguf", "F32", pre="qwen2")
    store = Store(tmp_path / "models")
    for name, source in (("dir", hf), ("gguf", gguf)):
        for _ in store.plan_create(CreateSpec(name=name, from_=str(source))).run():
            pass
    messages = [{"role": "user", "content": "Why is the sky blue? naïve cafe\u0301 <think>"}]
    options = {"temperature": 0, "num_predict": 12}
    with LiveServer(make_cfg(store.root)) as server:
        client = ollama.Client(host=server.url)
        a, b = (client.chat(m, messages=messages, options=options) for m in ("dir", "gguf"))
    assert a.prompt_eval_count == b.prompt_eval_count
    assert a.message.content == b.message.content and a.eval_count == b.eval_count
