"""FreeToken: an Ollama-compatible server for Mixture-of-Experts models."""

__version__ = "0.1.0"

# What /api/version reports. Ollama clients compare this against the features they need
# (and the CLI warns when client and server differ), so it names the Ollama release whose
# API this server follows rather than FreeToken's own version.
OLLAMA_VERSION = "0.12.0"
