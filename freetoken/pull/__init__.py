"""Registry client: pull models into the store and push them out (docs/architecture.md,
"The registry protocol"). Torch-free; a GGUF layer is converted in a child process."""

from freetoken.pull.client import RegistryClient, RegistryError
from freetoken.pull.downloads import Transfers
from freetoken.pull.parts import TransferOptions
from freetoken.pull.pull import PullStats, pull, pull_model
from freetoken.pull.push import PushStats, push, push_model
from freetoken.pull.wire import Remote, locate

__all__ = [
    "PullStats",
    "PushStats",
    "RegistryClient",
    "RegistryError",
    "Remote",
    "TransferOptions",
    "Transfers",
    "locate",
    "pull",
    "pull_model",
    "push",
    "push_model",
]
