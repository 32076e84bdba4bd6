"""Converts a Hugging Face directory or a GGUF file to FTW (or an FTW model, to quantize it).

    python -m freetoken.ftw.convert SRC OUT [--shard-gib 2] [--json-progress] [--quantize q4_K_M]

Banks are assembled and written one (layer, bank) at a time, so memory stays near one
layer's experts whatever the model's size. With --json-progress the last line names each
file's SHA-256 digest, computed as it was written.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from freetoken import models
from freetoken.ftw import DEFAULT_SHARD_LIMIT, INDEX, FtwError, round_up
from freetoken.ftw.quantize import BankQuantizer
from freetoken.ftw.reader import require_host_memory
from freetoken.ftw.writer import Writer
from freetoken.models import hub
from freetoken.weights import safetensors_dir

log = logging.getLogger(__name__)

CONVERTER_VERSION = "1"
Progress = Callable[[int, int], None]
_SKIP = {"model.safetensors.index.json", "ftw.json"}


def files_of_dir(path: Path) -> dict[str, Path]:
    if not path.is_dir():
        raise FtwError(f"{path}: not a directory")
    return {p.name: p for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(".")}


_METADATA_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")


def metadata_files(files: dict[str, Path]) -> dict[str, Path]:
    """The configs, tokenizer data and templates carried along with the weights."""
    return {n: p for n, p in files.items() if n not in _SKIP and n.endswith(_METADATA_SUFFIXES)}


def fingerprint(files: dict[str, Path]) -> str:
    h = hashlib.sha256(CONVERTER_VERSION.encode())
    for name in sorted(files):
        h.update(f"{name}\0{Path(files[name]).stat().st_size}\0".encode())
    return h.hexdigest()[:16]


def convert_hf(
    files: dict[str, Path],
    out: Path,
    *,
    shard_limit: int = DEFAULT_SHARD_LIMIT,
    progress: Progress | None = None,
    quantize: str | None = None,
) -> tuple[Path, dict[str, str]]:
    """Writes FTW; returns its directory and each file's digest."""
    if "config.json" not in files:
        raise FtwError("the source has no config.json")
    config = hub.read_config(files)
    cls = models.load_class(config)
    sources = safetensors_dir.safetensors_files(files)
    total = sum(p.stat().st_size for p in sources)
    writer = Writer(out, shard_limit)
    try:
        with safetensors_dir.Checkpoint(files, cls) as ck:
            if quantize is None:
                # a model this host could not load is refused now, before an hour of writing
                # (a quantized one is judged at load, on the bytes it comes to)
                need = ck.nbytes()
                require_host_memory(need, "the model's weights (read into memory to serve)")
            done = 0
            for name, t, fmt in ck.dense_items():
                writer.add_dense(name, t, fmt)
                done = _report(progress, done + t.nbytes, total)
            banks = BankQuantizer(quantize, [layer for layer, _ in ck.bank_keys()])
            for layer, bank in ck.bank_keys():
                t, fmt = ck.bank((layer, bank))
                writer.add_bank(layer, bank, *banks(layer, bank, t, fmt))
                done = _report(progress, done + t.nbytes, total)
            _report(progress, total, total)  # the files' headers are read too
        meta = {
            "model_type": config.get("model_type"),
            "model_info": cls.model_info(config),
            "source": {
                "format": "safetensors",
                "fingerprint": fingerprint(files),
                "files": sorted(p.name for p in sources),
            },
            **({"quantize": banks.qtype} if banks.qtype else {}),
        }
        return writer.close(meta, metadata_files(files)), writer.digests
    except BaseException:
        writer.abort()
        raise


def convert_ftw(
    files: dict[str, Path],
    out: Path,
    *,
    shard_limit: int = DEFAULT_SHARD_LIMIT,
    progress: Progress | None = None,
    quantize: str | None = None,
) -> tuple[Path, dict[str, str]]:
    """An FTW model written anew, its expert banks quantized (a model already in the store);
    returns its directory and each file's digest."""
    from freetoken.ftw import reader

    source = json.loads(Path(files[INDEX]).read_text())
    weights = reader.read(files, pin=False)
    banks = BankQuantizer(quantize, [layer for layer, _ in weights.banks])
    writer = Writer(out, shard_limit)
    try:
        done, total = 0, int(source["total_bytes"])
        for name, t in weights.dense.items():
            writer.add_dense(name, t, weights.formats.get(name))
            done = _report(progress, done + t.nbytes, total)
        for (layer, bank), t in sorted(weights.banks.items()):
            fmt = weights.formats.get((layer, bank))
            writer.add_bank(layer, bank, *banks(layer, bank, t, fmt))
            done = _report(progress, done + t.nbytes, total)
        _report(progress, total, total)  # alignment padding is read too
        meta = {k: source[k] for k in ("model_type", "model_info", "source") if k in source}
        if banks.qtype:
            meta["quantize"] = banks.qtype
        kept = {n: files[n] for n in source.get("metadata_files") or [] if n in files}
        return writer.close(meta, kept), writer.digests
    except BaseException:
        writer.abort()
        raise


def _report(progress: Progress | None, done: int, total: int) -> int:
    """Reports the source bytes written so far; returns them."""
    if progress is not None:
        progress(min(done, total), total)
    return done


def convert_files(
    src: Path, out: Path, note: Callable[[str], None] | None = None, **kw
) -> tuple[Path, dict[str, str]]:
    """A Hugging Face directory, a GGUF file or an FTW model (to quantize it) as FTW: its
    directory and each file's digest.

    `note` hears what the user should know about the conversion (dequantized types);
    quantize="q4_K_M" or "q8_0" quantizes the expert banks (ftw/quantize.py)."""
    src = Path(src)
    if src.is_file() and src.suffix == ".gguf":
        from freetoken.ftw.gguf_convert import convert_gguf

        return convert_gguf(src, out, note=note, **kw)
    files = files_of_dir(src)
    if INDEX in files:
        return convert_ftw(files, out, **kw)
    return convert_hf(files, out, **kw)


def convert(src: Path, out: Path, **kw) -> Path:
    """As `convert_files`, the directory only."""
    return convert_files(src, out, **kw)[0]


def _progress_printer(json_lines: bool) -> Progress:
    t0 = time.perf_counter()
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] < 0.2 and done < total:
            return
        last[0] = now
        rate = done / max(now - t0, 1e-9) / 1e9
        if json_lines:
            print(
                json.dumps({"status": "converting model", "completed": done, "total": total}),
                flush=True,
            )
        else:
            print(
                f"\rconverting {done / 1e9:.2f}/{total / 1e9:.2f} GB ({rate:.2f} GB/s)",
                end="",
                file=sys.stderr,
                flush=True,
            )

    return report


def _note_printer(json_lines: bool) -> Callable[[str], None]:
    def note(text: str) -> None:
        if json_lines:
            print(json.dumps({"status": text}), flush=True)
        else:
            print(text, file=sys.stderr, flush=True)

    return note


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="freetoken convert", description="Convert a model to FTW.")
    ap.add_argument("src", type=Path, help="a Hugging Face directory or a .gguf file")
    ap.add_argument("out", type=Path, help="the FTW directory to write")
    ap.add_argument("--shard-gib", type=float, default=DEFAULT_SHARD_LIMIT / 2**30)
    ap.add_argument("--json-progress", action="store_true", help="progress as JSON lines on stdout")
    ap.add_argument("--quantize", help="quantize the expert banks: q4_K_M or q8_0")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # Conversion moves bytes: a copy is memory-bound, and one thread does it at memory speed
    # while the writer's thread writes and hashes. More torch threads only wait on each
    # other, and where the cores are shared they stalled small copies tenfold. Quantizing
    # is arithmetic, though, and keeps every core.
    if not args.quantize:
        torch.set_num_threads(1)
    limit = round_up(int(args.shard_gib * 2**30))
    try:
        out, digests = convert_files(
            args.src,
            args.out,
            shard_limit=limit,
            progress=_progress_printer(args.json_progress),
            note=_note_printer(args.json_progress),
            quantize=args.quantize,
        )
    except (FtwError, ValueError, OSError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if args.json_progress:
        print(json.dumps({"status": "success", "path": str(out), "digests": digests}), flush=True)
    else:
        print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
