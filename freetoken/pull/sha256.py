"""SHA-256 whose running state can be saved, so a resumed download hashes only new bytes.

hashlib cannot export the state of a hash in progress. OpenSSL's `SHA256_CTX` is a plain
public struct (sha.h) and its `SHA256_*` functions are exported by the libcrypto that
hashlib itself links, so its bytes are a state that can be written to disk and loaded into
a new context. Where that library cannot be found, or fails the self-test, `Sha256` falls
back to hashlib and `state()` is None: a resume then hashes the file from its start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
from typing import Any

__all__ = ["Sha256"]

# SHA256_CTX: h[8], Nl, Nh, data[16], num, md_len (all 32-bit): 112 bytes.
_CTX_SIZE = 112


def _load() -> Any:
    """The libcrypto functions, or None."""
    candidates = []
    try:
        import _hashlib

        # dlsym on the extension also finds the symbols of the libcrypto it links.
        candidates.append(_hashlib.__file__)
    except (ImportError, AttributeError):
        pass
    if found := ctypes.util.find_library("crypto"):
        candidates.append(found)
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            fns = (lib.SHA256_Init, lib.SHA256_Update, lib.SHA256_Final)
        except (OSError, AttributeError):
            continue
        for fn in fns:
            fn.restype = ctypes.c_int
        lib.SHA256_Update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        return lib
    return None


def _address(data: Any) -> tuple[Any, int]:
    """(pointer argument, length) for bytes or a writable buffer, without a copy."""
    if not isinstance(data, bytes):
        view = memoryview(data).cast("B")
        if not view.readonly:
            return (ctypes.c_char * len(view)).from_buffer(view), len(view)
        data = bytes(view)
    return data, len(data)


class Sha256:
    """`Sha256(state)` continues from a saved `state()`; update takes bytes or a writable
    buffer (a bytearray or a view of one)."""

    resumable = False  # set below, once the library has passed the self-test

    def __init__(self, state: bytes | None = None):
        self._py = None if self.resumable else hashlib.sha256()
        if self._py is not None:
            if state is not None:
                raise ValueError("this Python cannot resume a SHA-256 state")
            return
        self._ctx = ctypes.create_string_buffer(_CTX_SIZE)
        if state is None:
            _LIB.SHA256_Init(self._ctx)
        elif len(state) == _CTX_SIZE:
            ctypes.memmove(self._ctx, state, _CTX_SIZE)
        else:
            raise ValueError("not a saved SHA-256 state")

    def update(self, data: Any) -> None:
        if self._py is not None:
            self._py.update(data)
            return
        pointer, n = _address(data)
        if n:
            _LIB.SHA256_Update(self._ctx, pointer, n)  # ctypes lets go of the GIL meanwhile

    def state(self) -> bytes | None:
        return None if self._py is not None else self._ctx.raw

    def hexdigest(self) -> str:
        if self._py is not None:
            return self._py.hexdigest()
        ctx = ctypes.create_string_buffer(self._ctx.raw, _CTX_SIZE)  # Final wipes its context
        out = ctypes.create_string_buffer(32)
        _LIB.SHA256_Final(out, ctx)
        return out.raw.hex()


def _self_test() -> bool:
    data = bytearray(range(256)) * 41  # not a multiple of the 64-byte block
    try:
        first = Sha256()
        first.update(data[:1000])
        second = Sha256(first.state())
        second.update(memoryview(data)[1000:])
        second.update(b"x")
        return second.hexdigest() == hashlib.sha256(bytes(data) + b"x").hexdigest()
    except (OSError, ValueError, TypeError, AttributeError):
        return False


_LIB = _load()
if _LIB is not None:
    Sha256.resumable = True
    Sha256.resumable = _self_test()
