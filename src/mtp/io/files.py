"""Checkpoint files: which safetensors files a folder holds, reading them lazily, writing them atomically.

Nothing here knows about models: tensor names are the file's own. A folder holds `model.safetensors`, or
shards listed in `model.safetensors.index.json`, or any `*.safetensors` files.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from .safetensors_mmap import CheckpointError, SafetensorsFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call write(tmp) on a temporary file beside `path`, then rename it over `path` (a reader never sees a
    half-written file; a failure leaves the old one)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (from the index when sharded)."""
    path = Path(path)
    if (path / INDEX).exists():
        try:
            index = json.loads((path / INDEX).read_text())
            names = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
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


def save_tensors(state: dict[str, torch.Tensor], path: Path, max_shard_bytes: int | None = None,
                 metadata: dict[str, str] | None = None) -> None:
    """Write tensors as model.safetensors (or shards + index when over max_shard_bytes), each file atomically;
    older weight files in the folder are removed first."""
    path = Path(path)
    meta = {"format": "pt", **(metadata or {})}
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    total = sum(v.numel() * v.element_size() for v in state.values())
    for old in list(path.glob("model*.safetensors")) + ([path / INDEX] if (path / INDEX).exists() else []):
        old.unlink()
    if max_shard_bytes is None or total <= max_shard_bytes:
        atomic_write(path / SINGLE, lambda tmp: save_file(state, tmp, metadata=meta))
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
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        atomic_write(path / name, lambda tmp, s=shard: save_file(s, tmp, metadata=meta))
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_text(path / INDEX, json.dumps(index, indent=2) + "\n")
