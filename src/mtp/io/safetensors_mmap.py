"""A memory-mapped safetensors reader whose errors name the file and the tensor.

The `safetensors` package memory-maps files too (`safe_open`, since 0.3). This reader is kept for what it adds:
the whole header is validated up front with one message naming the file and the tensor (offsets in range, not
overlapping, covering the data without a gap; shapes and dtypes consistent with each tensor's byte length), a
tensor's pages can be dropped from memory once it has been copied out (`release`), and the map is copy-on-write,
so tensors are writable views of the page cache until they are converted or written to. `tests/test_safetensors.py`
cross-checks it against `safe_open` on valid and damaged files.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# The safetensors format's own limit on the JSON header (its reader refuses larger ones).
MAX_HEADER_BYTES = 100_000_000
ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, damaged or does not fit the model (names file and tensor)."""


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key '{key}' appears twice")
        out[key] = value
    return out


class SafetensorsFile:
    """Lazy tensors of one .safetensors file: `keys()`, `shape(name)`, `dtype(name)`, `tensor(name)`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            fh = open(self.path, "rb")
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        with fh:  # the map keeps its own reference to the file: the descriptor is not needed afterwards
            size = self.path.stat().st_size
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated or corrupt safetensors file (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{self.path}: truncated or corrupt safetensors file (header of {n} bytes "
                                      f"in a file of {size})")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({n} bytes; the format allows at "
                                      f"most {MAX_HEADER_BYTES})")
            try:
                header = json.loads(fh.read(n), object_pairs_hook=_no_duplicates)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CheckpointError(f"{self.path}: corrupt safetensors header (not JSON)") from None
            except ValueError as e:  # a duplicate key
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
            self._base = 8 + n
            self._entries = self._check(header, size - self._base)
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size else None

    def _check(self, header, data_size: int) -> dict[str, dict]:
        """The header's tensor entries, after checking all of it: a JSON object of tensors, each with
        `dtype` (known), `shape` (integers >= 0) and `data_offsets` [start, end] within the data, whose length is
        the shape's size in that dtype; the tensors tile the data bytes (no overlap, no gap), as the format requires.
        `__metadata__`, when present, is an object of strings."""
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (a JSON {type(header).__name__}, "
                                  "not an object)")
        metadata = header.pop("__metadata__", None)
        if metadata is not None and not (isinstance(metadata, dict)
                                         and all(isinstance(v, str) for v in metadata.values())):
            raise CheckpointError(f"{self.path}: corrupt safetensors header ('__metadata__' must map strings to "
                                  "strings)")
        self.metadata = metadata or {}
        spans = []
        for name, e in header.items():
            where = f"{self.path}: corrupt safetensors header: tensor '{name}'"
            if not isinstance(e, dict):
                raise CheckpointError(f"{where} is a JSON {type(e).__name__}, not an object")
            if ENTRY_KEYS - set(e):  # other keys are ignored, as the safetensors package ignores them
                raise CheckpointError(f"{where} lacks {', '.join(repr(k) for k in sorted(ENTRY_KEYS - set(e)))}")
            dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise CheckpointError(f"{where} has unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
            if not isinstance(shape, list) or not all(_int(s) and s >= 0 for s in shape):
                raise CheckpointError(f"{where} has shape {shape!r}; expected a list of integers >= 0")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(_int(o) for o in offsets)
                    and 0 <= offsets[0] <= offsets[1]):
                raise CheckpointError(f"{where} has data_offsets {offsets!r}; expected [start, end] with "
                                      "0 <= start <= end")
            start, end = offsets
            if end > data_size:
                raise CheckpointError(f"{self.path}: truncated: tensor '{name}' needs bytes {start}..{end} "
                                      f"but the file holds {data_size} data bytes")
            numel = 1
            for s in shape:
                numel *= s
            if end - start != numel * DTYPES[dtype].itemsize:
                raise CheckpointError(f"{self.path}: corrupt: tensor '{name}' has {end - start} bytes but shape "
                                      f"{shape} in {dtype} needs {numel * DTYPES[dtype].itemsize}")
            spans.append((start, end, name))
        at, previous = 0, None
        for start, end, name in sorted(spans):
            if start < at:
                raise CheckpointError(f"{self.path}: corrupt safetensors header: tensors '{previous}' and '{name}' "
                                      f"overlap (bytes {start}..{at})")
            if start > at:
                raise CheckpointError(f"{self.path}: corrupt safetensors header: data bytes {at}..{start} belong to "
                                      f"no tensor (before '{name}')")
            at, previous = max(at, end), name
        if at != data_size:
            raise CheckpointError(f"{self.path}: corrupt safetensors header: data bytes {at}..{data_size} at the end "
                                  "belong to no tensor")
        return header

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._entries[name]["dtype"]]

    def nbytes(self, name: str) -> int:
        start, end = self._entries[name]["data_offsets"]
        return end - start

    def tensor(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        start, end = e["data_offsets"]
        dtype = DTYPES[e["dtype"]]
        if end == start:
            return torch.empty(e["shape"], dtype=dtype)
        if self._mm is None:
            raise CheckpointError(f"{self.path}: file already closed (reading tensor '{name}')")
        t = torch.frombuffer(self._mm, dtype=dtype, count=(end - start) // dtype.itemsize,
                             offset=self._base + start)
        return t.view(e["shape"])

    def release(self, name: str) -> None:
        """Drop a tensor's pages from memory once it has been copied out (they are read from the file again if it
        is ever touched): loading a converted checkpoint then peaks near one copy of the weights. Only pages that lie
        wholly inside the tensor are dropped, so a neighbour kept as a view of the map is never touched."""
        if self._mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, end = self._entries[name]["data_offsets"]
        page = mmap.PAGESIZE
        lo = -(-(self._base + start) // page) * page
        hi = (self._base + end) // page * page
        if hi > lo:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def close(self) -> None:
        """Let go of the map (the file descriptor was closed when it was mapped). Tensors taken from this file
        hold their own reference to the map, so it is unmapped only when the last of them is freed: closing never
        invalidates them (an explicit mmap.close() would, as torch.frombuffer does not pin the buffer)."""
        self._mm = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
