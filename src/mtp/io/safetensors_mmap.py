"""A memory-mapped safetensors reader with errors that name the file and the tensor.

The `safetensors` package reads whole tensors into memory and reports a damaged file without saying
which tensor is cut off; this reader maps the file copy-on-write, so tensors are views of the page
cache until they are converted or written to.
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


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, damaged or does not fit the model (names file and tensor)."""


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
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CheckpointError(f"{self.path}: corrupt safetensors header (not JSON)") from None
            self.metadata = header.pop("__metadata__", None) or {}
            self._entries = header
            self._base = 8 + n
            self._check(header, size - self._base)
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size else None

    def _check(self, header: dict, data_size: int) -> None:
        for name, e in header.items():
            start, end = e["data_offsets"]
            if e["dtype"] not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype {e['dtype']}")
            if end > data_size:
                raise CheckpointError(f"{self.path}: truncated: tensor '{name}' needs bytes {start}..{end} "
                                      f"but the file holds {data_size} data bytes")
            numel = 1
            for s in e["shape"]:
                numel *= s
            if end - start != numel * DTYPES[e["dtype"]].itemsize:
                raise CheckpointError(f"{self.path}: corrupt: tensor '{name}' byte size does not match its shape")

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
