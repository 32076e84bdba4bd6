"""Every FreeToken setting, read from the environment in this one module.

Each setting has a FREETOKEN_* name, optional OLLAMA_* aliases (so an Ollama user's
environment keeps working), a parser, a default and a one-line description. A bad value
fails loudly at start-up with the variable's name; nothing falls back silently.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import platformdirs

__all__ = ["Config", "ConfigError", "Host", "SETTINGS", "current", "load", "parse_duration"]

from freetoken.config_experts import EXPERT_SETTINGS
from freetoken.config_values import (  # noqa: F401  (re-exported: callers name them as config.X)
    ADAPTIVE_MODES,
    MAX_DURATION_S,
    MOE_POLICIES,
    ConfigError,
    Host,
    Setting,
    _adaptive_modes,
    _choice,
    _csv,
    _fraction_or_auto,
    _gpus,
    _nonneg_int,
    _path,
    _pos_int,
    _think_budgets,
    keep_alive_seconds,
    parse_bool,
    parse_duration,
    parse_host,
    parse_registry,
    parse_size,
)


def _default_models() -> Path:
    return Path(platformdirs.user_data_dir("freetoken")) / "models"


def _default_key() -> Path:
    # Ollama's identity, where the user has one: a key registered with its registry works
    ollama = Path.home() / ".ollama" / "id_ed25519"
    return (
        ollama if ollama.exists() else Path(platformdirs.user_data_dir("freetoken")) / "id_ed25519"
    )


def _default_cache() -> Path:
    return Path(platformdirs.user_cache_dir("freetoken"))


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "host",
        "FREETOKEN_HOST",
        parse_host,
        "127.0.0.1:11434",
        "address the server binds and clients call",
        ("OLLAMA_HOST",),
    ),
    Setting(
        "models",
        "FREETOKEN_MODELS",
        _path,
        None,
        "model store directory (manifests/ and blobs/)",
        ("OLLAMA_MODELS",),
    ),
    Setting(
        "cache_dir",
        "FREETOKEN_CACHE_DIR",
        _path,
        None,
        "per-machine cache: bandwidth profiles, compiled kernels",
    ),
    Setting(
        "keep_alive",
        "FREETOKEN_KEEP_ALIVE",
        parse_duration,
        "5m",
        "how long an idle model stays loaded; negative keeps it forever",
        ("OLLAMA_KEEP_ALIVE",),
    ),
    Setting(
        "context_length",
        "FREETOKEN_CONTEXT_LENGTH",
        _nonneg_int,
        "0",
        "default num_ctx; 0 picks 4096 (capped by the model)",
        ("OLLAMA_CONTEXT_LENGTH",),
    ),
    Setting(
        "num_parallel",
        "FREETOKEN_NUM_PARALLEL",
        _pos_int,
        "4",
        "sequences one model decodes together",
        ("OLLAMA_NUM_PARALLEL",),
    ),
    Setting(
        "max_loaded_models",
        "FREETOKEN_MAX_LOADED_MODELS",
        _nonneg_int,
        "0",
        "models kept loaded at once; 0 means 3",
        ("OLLAMA_MAX_LOADED_MODELS",),
    ),
    Setting(
        "max_queue",
        "FREETOKEN_MAX_QUEUE",
        _pos_int,
        "512",
        "requests waiting per server before 503",
        ("OLLAMA_MAX_QUEUE",),
    ),
    Setting(
        "load_timeout",
        "FREETOKEN_LOAD_TIMEOUT",
        parse_duration,
        "5m",
        "how long a model may take to load",
        ("OLLAMA_LOAD_TIMEOUT",),
    ),
    Setting(
        "max_request_size",
        "FREETOKEN_MAX_REQUEST_SIZE",
        parse_size,
        "64MiB",
        "largest request body the API reads (blob uploads are not bounded)",
    ),
    Setting("origins", "FREETOKEN_ORIGINS", _csv, "", "extra CORS origins", ("OLLAMA_ORIGINS",)),
    Setting(
        "noprune",
        "FREETOKEN_NOPRUNE",
        parse_bool,
        "0",
        "keep unreferenced blobs at start-up",
        ("OLLAMA_NOPRUNE",),
    ),
    Setting("debug", "FREETOKEN_DEBUG", parse_bool, "0", "verbose logging", ("OLLAMA_DEBUG",)),
    Setting(
        "device",
        "FREETOKEN_DEVICE",
        _choice("auto", "cpu", "cuda"),
        "auto",
        "where dense weights and the KV cache live",
    ),
    Setting(
        "gpus",
        "FREETOKEN_GPUS",
        _gpus,
        "auto",
        "GPUs a runner spreads a model's experts over, one process each: auto (every visible "
        "one), a list like 0,1, or cpu:N (N ranks on the CPU, to test the distributed path)",
    ),
    Setting(
        "dtype",
        "FREETOKEN_DTYPE",
        _choice("auto", "float32", "bfloat16", "float16"),
        "auto",
        "compute dtype; auto keeps the checkpoint's (float32 stays float32 on the CPU)",
    ),
    Setting("kv_page_size", "FREETOKEN_KV_PAGE_SIZE", _pos_int, "16", "tokens per KV-cache page"),
    Setting(
        "kv_cache_size",
        "FREETOKEN_KV_CACHE_SIZE",
        parse_size,
        "0",
        "memory for the KV cache of each loaded model, shared by its sequences and the prefix "
        "cache (0: room for max(2 x num_ctx, num_parallel x min(num_ctx, 8192)) tokens)",
    ),
    Setting(
        "anchor_cache_size",
        "FREETOKEN_ANCHOR_CACHE_SIZE",
        parse_size,
        "0",
        "host memory for hybrid models' recurrent-state checkpoints at anchors, shared by "
        "their sequences (0: a tenth of the memory available at load, at most 16 GiB)",
    ),
    Setting(
        "prefix_cache",
        "FREETOKEN_PREFIX_CACHE",
        parse_bool,
        "1",
        "keep computed KV pages for reuse by later requests that start with the same tokens",
    ),
    Setting(
        "prefill_chunk",
        "FREETOKEN_PREFILL_CHUNK",
        _pos_int,
        "8192",
        "most prompt tokens one step prefills (each chunk streams every layer's experts once)",
    ),
    Setting(
        "cuda_graphs",
        "FREETOKEN_CUDA_GRAPHS",
        parse_bool,
        "1",
        "replay decode steps from CUDA graphs (cut at experts ops that need the host)",
    ),
    Setting(
        "overlap",
        "FREETOKEN_OVERLAP",
        parse_bool,
        # on: through the server on the H200 (12 layers of Qwen3-30B-A3B, a three-quarter
        # cache) every regime ran as fast or faster with it, 1.5-2.7x at one stream
        "1",
        "launch a decode step from CUDA graphs before reading the last one's tokens, so the "
        "host's work on them (detokenizing, streaming, planning) runs while the GPU computes",
    ),
    *EXPERT_SETTINGS,
    Setting(
        "registry",
        "FREETOKEN_REGISTRY",
        parse_registry,
        "",
        "default registry for pull and push: host[:port] or http(s)://host[:port]",
    ),
    Setting(
        "think_budgets",
        "FREETOKEN_THINK_BUDGETS",
        _think_budgets,
        "low=1024,medium=4096,high=16384",
        "thinking tokens at most per think level (a level left out, or 0: no bound); the "
        "thinking's close marker is forced once they are spent (a request's own budget wins)",
    ),
    Setting(
        "registry_token",
        "FREETOKEN_REGISTRY_TOKEN",
        str,
        "",
        "bearer token sent to the registry for writes",
    ),
    Setting(
        "key",
        "FREETOKEN_KEY",
        _path,
        None,
        "ed25519 key (OpenSSH format) that signs registry token requests (default: Ollama's "
        "~/.ollama/id_ed25519 where it exists, else id_ed25519 in the data dir, made on first use)",
    ),
    Setting(
        "max_transfer_streams",
        "FREETOKEN_MAX_TRANSFER_STREAMS",
        _pos_int,
        "8",
        "parallel HTTP streams of a pull (ranged parts) or a push (layers)",
        ("OLLAMA_MAX_TRANSFER_STREAMS",),
    ),
    Setting(
        "runner_python",
        "FREETOKEN_RUNNER_PYTHON",
        str,
        "",
        "python executable for runner processes (default: the server's)",
    ),
    Setting(
        "warm_start",
        "FREETOKEN_WARM_START",
        parse_bool,
        "1",
        "the server keeps a converter and a runner started ahead, their imports done (saves "
        "each create and each model load torch's import, seconds; costs two idle processes)",
    ),
    Setting(
        "nohistory",
        "FREETOKEN_NOHISTORY",
        parse_bool,
        "0",
        "do not save the input history of interactive `run`",
        ("OLLAMA_NOHISTORY",),
    ),
    Setting(
        "history_file",
        "FREETOKEN_HISTORY_FILE",
        _path,
        None,
        "input history of interactive `run` (default: `history` in the user data directory)",
    ),
)


Config = dataclasses.make_dataclass(
    "Config",
    [(s.field, Any) for s in SETTINGS],
    frozen=True,
    slots=True,
    namespace={"__doc__": "Parsed settings; one attribute per entry of SETTINGS."},
)


def _raw(setting: Setting, environ: Mapping[str, str]) -> tuple[str, str] | None:
    for name in (setting.env, *setting.aliases):
        if name in environ:
            return name, environ[name]
    return None


def load(environ: Mapping[str, str] | None = None) -> Any:
    """Parse every setting; raises ConfigError naming the first bad variable."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for s in SETTINGS:
        found = _raw(s, env)
        name, text = found if found else (s.env, s.default)
        if text is None:
            values[s.field] = None
            continue
        try:
            values[s.field] = s.parse(text)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{name}={text!r}: {e}") from None
    if values["models"] is None:
        values["models"] = _default_models()
    if values["cache_dir"] is None:
        values["cache_dir"] = _default_cache()
    if values["key"] is None:
        values["key"] = _default_key()
    return Config(**values)


@functools.cache
def current() -> Any:
    """The settings of this process, parsed once."""
    return load()


# NVLink multicast (NVLS, symmetric-memory multicast) stays off in every rank of a runner: a
# program that uses it can put a shared host's GPUs out of service, and a bs=1 reduce gains nothing.
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def child_environment(overrides: Mapping[str, str]) -> dict[str, str]:
    """The environment a process started here begins with: this one's, with `overrides`."""
    return {**os.environ, **overrides}


def cuda_visible_devices() -> str | None:
    """CUDA's own mask (not a FreeToken setting): which GPUs, by index or UUID, torch numbers
    0, 1, ... in this process and its runners; None where it is unset."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def export_rank_env() -> None:
    """Sets what NCCL reads in this process and what its rank processes inherit."""
    os.environ.update(RANK_ENV)


def put_first_on_path(directory: Path) -> None:
    """Puts `directory` first on this process's PATH (and its children's), once."""
    here = str(directory)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[:1] != [here]:
        os.environ["PATH"] = here + (os.pathsep + path if path else "")


def describe() -> list[tuple[str, str, str]]:
    """(variable, current value, description) for `freetoken serve --help`-style listings."""
    cfg = current()
    return [(s.env, str(getattr(cfg, s.field)), s.description) for s in SETTINGS]
