"""`freetoken bench grammar`: what constrained decoding costs, on a vocabulary the size of a
production model's (tools/synthvocab.py: 151,643 byte-level tokens by default).

Masks: each grammar is compiled once (its compile time is reported), then its masks are
timed token by token along an answer it accepts, as the engine computes them (the work a
worker thread does while the model step runs: the bitmask row and its stop-token bits): a
JSON schema with pattern, format, numeric bounds, an enum and a long string; a forced tool
call; free text in which a tool call opens (`auto`, what every request with tools decodes
under).

Decode: the engine over a random-weight model of the `tiny` shape with that vocabulary, on
the GPU when there is one (with CUDA graphs, as the server runs it) else on the CPU, the
same number of tokens free, under the `auto` grammar and under a JSON schema, the modes
alternated `--repeats` times; tok/s count the tokens of timed decode steps only (not the
one the prefill samples), the ratio is to free. On the CPU the model step and the mask
worker share the cores, so the ratio there also prices the mask's CPU time.

`engine µs` is the engine thread's wall time a decode step outside the model step
(`Engine._execute`: on a GPU, its launch) and the token readback (on a GPU, the wait for
the device): what constrained decoding adds there (`+µs`, over free) lengthens every step
where the device waits for the host. `--shape a3b` decodes a model with Qwen3-30B-A3B's
hidden size, layers, attention and active experts (8 experts a layer, all active, instead
of 8 of 128: the same work a token, a 7 GB checkpoint), for the ratio at a real step time
beside the tiny model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freetoken.bench import common
from freetoken.chat.formats import QwenFormat
from freetoken.chat.grammar import Grammar, json_format
from freetoken.chat.structured import forced_tools, offered_tools
from freetoken.runtime import loader
from freetoken.runtime.constrain import Constraint, Grammars
from freetoken.runtime.engine import Engine
from freetoken.runtime.graphs import DecodeGraphs
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.masks import Masker
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from freetoken.runtime.tokenizer import Tokenizer
from freetoken.runtime.vocab import Vocab, token_bytes
from freetoken.tools import synth, synthvocab

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "tags": {"type": "array", "items": {"enum": ["math", "poetry", "engines"]}},
        "bio": {"type": "string"},
        "score": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.25},
    },
    "required": ["name", "age", "email", "code", "tags", "bio", "score"],
}
INSTANCE = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "code": "AL-1843",
    "tags": ["math", "poetry", "engines"],
    "bio": "She wrote the first published algorithm intended for a machine, the Analytical "
    "Engine, and saw that it could act on more than numbers: 日本語 too.",
    "score": 9.75,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": SCHEMA}},
]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}'
FREE = (
    "Let me look that up. The weather in Paris is usually mild in spring, and the forecast "
    "for the next few days should say whether to take an umbrella.\n\n"
)
COLUMNS_MASKS = [
    ("grammar", "grammar"),
    ("tokens", "tokens"),
    ("compile_ms", "compile ms"),
    ("mean_us", "mask µs/token"),
    ("p50_us", "p50"),
    ("p99_us", "p99"),
    ("max_us", "max"),
]
COLUMNS_DECODE = [
    ("mode", "decode"),
    ("tokens", "tokens"),
    ("tok_s", "tok/s"),
    ("step_ms", "ms/step"),
    ("spread", "±"),
    ("ratio", "/free"),
    ("host_us", "engine µs"),
    ("extra_us", "+µs"),
]
# Qwen3-30B-A3B's shape but for its 128 experts: 8, all active, the same work a token
A3B = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 8,
    "num_experts_per_tok": 8,
}
SHAPES = {"tiny": ({}, "float32"), "a3b": (A3B, "bfloat16")}


def _arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="freetoken bench grammar", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--vocab", type=int, default=151_643, help="byte-level tokens")
    ap.add_argument("--tokens", type=int, default=128, help="decoded per mode and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--shape", choices=sorted(SHAPES), default="tiny", help="the decode model (see above)"
    )
    ap.add_argument(
        "--device", default="auto", help="where the decode runs: auto (a GPU if any), cpu, cuda"
    )
    ap.add_argument(
        "--work", default="", help="where the checkpoint is written (default: a temp dir)"
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="launch each decode step before the last one's tokens are read (on a GPU)",
    )
    ap.add_argument("--json", action="store_true")
    return ap


def _walks(qwen: QwenFormat) -> list[tuple[str, Grammar, str]]:
    answer = json.dumps(INSTANCE, ensure_ascii=False)
    call = f"<tool_call>\n{CALL}\n</tool_call>"
    return [
        ("json schema", json_format(SCHEMA), answer),
        ("forced call", qwen.call_grammar(forced_tools(TOOLS, None)), call),
        ("auto (text, then a call)", qwen.auto_grammar(offered_tools(TOOLS)), FREE + call),
    ]


def masks(grammars: Grammars, qwen: QwenFormat) -> list[dict[str, Any]]:
    """Mask time per token along each grammar's walk."""
    rows, masker, vocab = [], Masker(), grammars.vocab
    for name, grammar, text in _walks(qwen):
        t0 = time.perf_counter()
        grammars.matcher(grammar)  # compiled and kept; the walk starts from a copy
        compile_ms = (time.perf_counter() - t0) * 1e3
        c = Constraint(grammars.matcher(grammar), vocab, [], grammars.eos_ids)
        times = []
        for token in vocab.encode(text):
            t = time.perf_counter()
            step = masker.fill([c])
            times.append((time.perf_counter() - t) * 1e6)
            if not step.allows(0, token):
                raise SystemExit(f"{name}: the mask rules out token {token} of its own walk")
            c.advance(token)
        us = np.array(times)
        rows.append(
            {
                "grammar": name,
                "tokens": len(times),
                "compile_ms": compile_ms,
                "mean_us": float(us.mean()),
                "p50_us": float(np.percentile(us, 50)),
                "p99_us": float(np.percentile(us, 99)),
                "max_us": float(us.max()),
            }
        )
    return rows


def _model(work: Path, size: int, shape: str = "tiny") -> Path:
    out = work / f"grammar-{shape}-{size}"
    if (out / "config.json").exists():
        return out
    tok = synthvocab.tokenizer(size)
    overrides, dtype = SHAPES[shape]
    synth.write_qwen3_moe(
        out, template=synth.CHAT_TEMPLATE, tokenizer=tok, dtype=dtype, **overrides
    )
    return out


class _Timed(Engine):
    """The engine, with the wall time its thread spends a step outside the model step and
    the token readback."""

    host_ns = 0

    def step(self) -> int:
        t = time.perf_counter_ns()
        n = super().step()
        self.host_ns += time.perf_counter_ns() - t
        return n

    def _execute(self, plan):
        t = time.perf_counter_ns()
        out = super()._execute(plan)
        self.host_ns -= time.perf_counter_ns() - t
        return out

    def _read(self, drawn):
        t = time.perf_counter_ns()
        out = super()._read(drawn)
        self.host_ns -= time.perf_counter_ns() - t
        return out


def _engine(path: Path, device: str, overlap: bool = False) -> Engine:
    files = {p.name: p for p in path.iterdir() if p.is_file()}
    loaded = loader.load(files, device, "auto")
    dev = loaded.device
    kv = KVCache(loaded.model.kv_layout(), 256, 16, loaded.dtype, dev)
    loader.place_experts(loaded, loader.Placement("adaptive", 0, None, 0, "auto", "auto"))
    graphs = DecodeGraphs(loaded.model, kv, dev, 4096, max_batch=1) if dev.type == "cuda" else None
    return _Timed(loaded.model, Tokenizer(files), kv, dev, 4096, 1, 2048, graphs, overlap=overlap)


def _decode(engine: _Timed, prompt: list[int], n: int, make: Any) -> tuple[int, float, float]:
    """Decode steps run, seconds taken and the engine thread's µs a step outside the model
    step and readback, over sequences until n steps are run (a grammar that completes
    starts over). The prefill's step, which samples the first token, is neither timed nor
    counted."""
    done, seconds, host_ns = 0, 0.0, 0
    while done < n:
        seq = Sequence(
            list(prompt), SamplingParams(temperature=1.0, seed=done), n - done + 1, frozenset()
        )
        seq.constraint = make()
        engine.submit(seq, lambda *_: None)
        engine.step()  # the prefill and first token: not a decode step
        steps, t0, engine.host_ns = 0, time.perf_counter(), 0
        while not seq.is_finished:
            engine.step()
            steps += 1
        while engine.step():  # a step launched ahead of the end lands, and is dropped
            pass
        seconds += time.perf_counter() - t0
        host_ns += engine.host_ns
        done += max(steps, 1)  # a sequence done at its first token still moves on
    return done, seconds, host_ns / 1e3 / done


def decode(
    engine: Engine, grammars: Grammars, qwen: QwenFormat, n: int, repeats: int
) -> list[dict[str, Any]]:
    prompt = engine.tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    strings = json_format({"type": "array", "items": {"type": "string"}})
    modes = {
        "free": lambda: None,
        "auto": lambda: Constraint(
            grammars.matcher(qwen.auto_grammar(offered_tools(TOOLS))),
            grammars.vocab,
            [],
            grammars.eos_ids,
        ),
        "json": lambda: Constraint(grammars.matcher(strings), grammars.vocab, [], grammars.eos_ids),
    }
    rates: dict[str, list[float]] = {m: [] for m in modes}
    host: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(repeats):
        for mode, make in modes.items():
            tokens, seconds, us = _decode(engine, prompt, n, make)
            rates[mode].append(tokens / seconds)
            host[mode].append(us)
    free, free_us = statistics.median(rates["free"]), statistics.median(host["free"])
    return [
        {
            "mode": mode,
            "tokens": n,
            "tok_s": statistics.median(r),
            "step_ms": 1e3 / statistics.median(r),
            "spread": (max(r) - min(r)) / 2,
            "ratio": statistics.median(r) / free,
            "host_us": statistics.median(host[mode]),
            "extra_us": statistics.median(host[mode]) - free_us,
        }
        for mode, r in rates.items()
    ]


def main(argv: list[str] | None = None) -> None:
    args = _arguments().parse_args(argv)
    head = common.header("grammar")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        path = _model(work, args.vocab, args.shape)
        engine = _engine(path, args.device, args.overlap)
        vocab = Vocab(
            token_bytes(engine.tokenizer.tok, QwenFormat.markers), engine.model.args.vocab_size
        )
        t0 = time.perf_counter()
        grammars = Grammars(vocab, engine.tokenizer.eos_ids)
        took = time.perf_counter() - t0
        print(f"# vocabulary: {vocab.size} tokens, read by the grammar engine in {took:.1f} s")
        where = engine.device.type
        threads = f", {torch.get_num_threads()} torch threads" if where == "cpu" else ""
        graphs = engine.graphs is not None
        print(
            f"# decode on {where}{threads}, shape {args.shape}, CUDA graphs: {graphs},"
            f" steps launched ahead: {engine.overlap}"
        )
        qwen = QwenFormat()
        common.emit(masks(grammars, qwen), COLUMNS_MASKS, args.json, head)
        rows = decode(engine, grammars, qwen, args.tokens, args.repeats)
        common.emit(rows, COLUMNS_DECODE, args.json, head)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
