"""Checkpoint files: which safetensors files a folder holds, reading them lazily, writing them so that a failure never
costs the previous checkpoint.

Nothing here knows about models: tensor names are the file's own. A folder holds `model.safetensors`, or
shards listed in `model.safetensors.index.json`, or any `*.safetensors` files.

Writing (`FolderWriter`): every file goes to a temporary beside its final name and is fsynced; only when all are
written are they renamed into place (then the folder is fsynced), and only then are the weight files of the previous
checkpoint that the new one does not use removed. A full disk (OSError ENOSPC) or any other error before that leaves
the folder exactly as it was.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from .safetensors_mmap import DTYPES, CheckpointError, SafetensorsFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def fsync_folder(path: Path) -> None:
    """Make the folder's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FolderWriter:
    """Files written into folder `path` as one change (see the module docstring). Use as a context manager: leaving
    the block without an error commits; an error removes the temporaries and re-raises. `write(name, fn)` calls
    fn(binary file). `replace_weights`: the weight files written are the folder's whole set, so the commit removes
    the previous checkpoint's that were not written anew (False: other files are left alone)."""

    def __init__(self, path: str | Path, replace_weights: bool = True):
        self.path = Path(path)
        self.replace_weights = replace_weights
        self.staged: dict[str, str] = {}  # final name -> temporary path

    def write(self, name: str, fn: Callable[[BinaryIO], None]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{name}.", suffix=".tmp")
        try:
            with open(fd, "wb") as f:
                fn(f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            os.unlink(tmp)
            raise OSError(e.errno, e.strerror or str(e), str(self.path / name)) from None
        except BaseException:
            os.unlink(tmp)
            raise
        self.staged[name] = tmp

    def write_text(self, name: str, text: str) -> None:
        self.write(name, lambda f: f.write(text.encode()))

    def copy(self, name: str, source: Path, chunk: int = 1 << 24) -> None:
        def fn(f: BinaryIO) -> None:
            with open(source, "rb") as src:
                while block := src.read(chunk):
                    f.write(block)
        self.write(name, fn)

    def stale(self) -> list[Path]:
        """The previous checkpoint's weight files: model*.safetensors and the shard index."""
        return sorted(self.path.glob("model*.safetensors")) + ([self.path / INDEX] if (self.path / INDEX).exists() else [])

    def commit(self) -> None:
        old = [p for p in self.stale() if p.name not in self.staged] if self.replace_weights else []
        for name, tmp in self.staged.items():
            os.replace(tmp, self.path / name)
        self.staged = {}
        fsync_folder(self.path)
        for p in old:
            p.unlink(missing_ok=True)

    def abort(self) -> None:
        for tmp in self.staged.values():
            Path(tmp).unlink(missing_ok=True)
        self.staged = {}

    def __enter__(self) -> FolderWriter:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()


def cache_root() -> Path:
    """Where mtp keeps what it builds once per machine (compiled graphs, the int8/int4 kernels): $MTP_CACHE, else
    ~/.cache/mtp."""
    return Path(os.environ.get("MTP_CACHE") or Path.home() / ".cache" / "mtp")


def atomic_write_text(path: Path, text: str) -> None:
    """Replace one text file atomically (written and fsynced beside it, then renamed)."""
    path = Path(path)
    with FolderWriter(path.parent, replace_weights=False) as w:
        w.write_text(path.name, text)


def write_safetensors(f: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Serialise tensors (CPU, contiguous) in the safetensors format, streaming each tensor's bytes to `f` (no copy of
    the whole file in memory; a write error is the OSError of `f.write`). The header is padded to 8 bytes."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    at = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for t in tensors.values():
        if t.numel():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (from the index when sharded)."""
    path = Path(path)
    if (path / INDEX).exists():
        try:
            index = json.loads((path / INDEX).read_text())
            names = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError, TypeError) as e:
            raise CheckpointError(f"{path / INDEX}: corrupt index ({e})") from None
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointError(f"{path / INDEX}: lists shard file(s) that do not exist: {', '.join(missing)}")
        return [path / n for n in names]
    if (path / SINGLE).exists():
        return [path / SINGLE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no model.safetensors, {INDEX} or *.safetensors file")
    return files


class TensorIndex(dict):
    """name -> (SafetensorsFile, name in that file) over every file of a folder; lazy (memory-mapped).

    Close it (or use it as a context manager) to release the files; tensors already taken from it stay valid."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)
        self.files: list[SafetensorsFile] = []
        try:
            for f in weight_files(self.path):
                st = SafetensorsFile(f)
                self.files.append(st)
                for key in st.keys():
                    if key in self:
                        raise CheckpointError(f"{f}: tensor '{key}' also appears in {self[key][0].path.name}")
                    self[key] = (st, key)
        except BaseException:
            self.close()
            raise

    def tensor(self, name: str) -> torch.Tensor:
        st, key = self[name]
        return st.tensor(key)

    def close(self) -> None:
        for st in self.files:
            st.close()

    def __enter__(self) -> TensorIndex:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_tensors(path: str | Path) -> TensorIndex:
    """Every tensor of a checkpoint folder under its file name (see TensorIndex)."""
    return TensorIndex(path)


def write_shards(out: FolderWriter, shards: list[dict[str, torch.Tensor] | Path], metadata: dict[str, str] | None = None) -> None:
    """The one shard writer: shards (tensors to serialise, or safetensors files to copy as they are) as
    model.safetensors when there is one, else model-0000i-of-0000n.safetensors + the index (weight map, total size)."""
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1 and isinstance(shards[0], dict):
        out.write(SINGLE, lambda f: write_safetensors(f, shards[0], meta))
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        if isinstance(shard, dict):
            out.write(name, lambda f, s=shard: write_safetensors(f, s, meta))
            sizes = {k: t.numel() * t.element_size() for k, t in shard.items()}
        else:
            out.copy(name, shard)
            with SafetensorsFile(shard) as st:
                sizes = {k: st.nbytes(k) for k in st.keys()}
        weight_map.update(dict.fromkeys(sizes, name))
        total += sum(sizes.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        out.write_text(INDEX, json.dumps(index, indent=2) + "\n")


def save_tensors(state: dict[str, torch.Tensor], out: FolderWriter, max_shard_bytes: int | None = None,
                 metadata: dict[str, str] | None = None) -> None:
    """Stage tensors as model.safetensors, or as shards + index when over max_shard_bytes (names in sorted order)."""
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    total = sum(v.numel() * v.element_size() for v in state.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        write_shards(out, [state], metadata)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(state):
        n = state[k].numel() * state[k].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = state[k]
        size += n
    write_shards(out, shards, metadata)
