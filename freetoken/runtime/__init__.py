"""The runner: engine step loop, KV cache, sampling, detokenization (imports torch)."""
