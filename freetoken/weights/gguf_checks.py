"""A GGUF reader that checks the tensor table before it maps a tensor.

gguf's own reader maps each tensor from its type and shape alone: an unknown type number
fails without the tensor's name, and a tensor whose declared size runs into the next
tensor's bytes is read silently (as whatever follows). Here each entry is checked first,
and the error names the tensor.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from freetoken.weights import WeightsError

__all__ = ["CheckedReader"]


class CheckedReader(GGUFReader):
    # gguf calls this with the parsed tensor-info fields once the header is read; each field's
    # parts are (name length, name, dims count, dims, type, offset), as its own code reads them
    def _build_tensors(self, start_offs: int, fields: list) -> None:
        extents = [_extent(f, start_offs) for f in fields]
        extents.sort(key=lambda e: e[1])
        ends = [start for _, start, _, _ in extents[1:]] + [len(self.data)]
        for (name, start, nbytes, what), limit in zip(extents, ends):
            if start + nbytes > limit:
                raise WeightsError(
                    f"tensor {name}: {what} needs {nbytes} bytes, but only {limit - start} "
                    "lie before the next tensor or the end of the file"
                )
        super()._build_tensors(start_offs, fields)


def _extent(field, start_offs: int) -> tuple[str, int, int, str]:
    """(name, data offset, bytes, a description) of one tensor-info entry."""
    _, name_data, _, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", errors="replace")
    code = int(raw_type[0])
    try:
        qtype = GGMLQuantizationType(code)
    except ValueError:
        raise WeightsError(f"tensor {name}: unknown GGUF tensor type {code}") from None
    block, size = GGML_QUANT_SIZES[qtype]
    shape = [int(d) for d in reversed(dims.tolist())]
    what = f"{qtype.name} {shape}"
    if shape and shape[-1] % block:
        raise WeightsError(f"tensor {name}: {what} rows are not whole {block}-weight blocks")
    count = 1
    for d in shape:
        count *= d
    return name, start_offs + int(offset[0]), count // block * size, what
