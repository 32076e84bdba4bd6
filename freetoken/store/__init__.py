"""The local model store (Ollama's layout): names, blobs, manifests, Modelfiles, create,
copy and delete."""

from freetoken.store.blobs import BlobStore, DigestMismatch
from freetoken.store.create import CreateError, CreatePlan, CreateSpec, FilesNotVisible, LocalFile
from freetoken.store.models import ModelNotFound, ModelView, Store
from freetoken.store.names import InvalidName, Name

__all__ = [
    "BlobStore",
    "CreateError",
    "CreatePlan",
    "CreateSpec",
    "DigestMismatch",
    "FilesNotVisible",
    "InvalidName",
    "LocalFile",
    "ModelNotFound",
    "ModelView",
    "Name",
    "Store",
]
