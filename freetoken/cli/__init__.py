"""The `freetoken` command: an HTTP client of the server with Ollama's verbs.

Nothing here imports torch or the server packages (except `serve`, lazily), so every
command other than `serve` starts in a fraction of a second.
"""
