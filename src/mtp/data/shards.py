"""Packed token shards: raw uint16/uint32 files read through np.memmap, described by `index.json`.

Layout of a data folder: `index.json`, `{split}-{n:05d}.bin`, `val_files.txt`, tokenizer files.
Documents are concatenated with `<|endoftext|>` after each one; a split is one long token stream.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

INDEX = "index.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ShardWriter:
    """Append token ids for one split; files roll over at `shard_tokens`."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int = 1 << 26):
        self.folder, self.split, self.dtype, self.shard_tokens = folder, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._fh = None
        self._n = 0
        self.tokens = 0
        self.documents = 0

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._fh = open(self.folder / name, "wb")
        self.shards.append({"file": name, "tokens": 0})
        self._n = 0

    def add(self, ids: list[int]) -> None:
        arr = np.asarray(ids, dtype=self.dtype)
        self.documents += 1
        while len(arr):
            if self._fh is None or self._n >= self.shard_tokens:
                self.close_file()
                self._open()
            take = arr[: self.shard_tokens - self._n]
            self._fh.write(take.tobytes())
            self._n += len(take)
            self.shards[-1]["tokens"] += len(take)
            self.tokens += len(take)
            arr = arr[len(take):]

    def close_file(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def summary(self) -> dict:
        self.close_file()
        return {"shards": self.shards, "tokens": self.tokens, "documents": self.documents}


class TokenShards:
    """Read-only view of one split as a single token stream: `len()`, `read(start, n)` -> np.int64 [n]."""

    def __init__(self, folder: str | Path, split: str = "train"):
        self.folder = Path(folder)
        f = self.folder / INDEX
        if not f.exists():
            raise FileNotFoundError(f"{self.folder}: no {INDEX} (build the data folder with `mtp data`)")
        self.index = json.loads(f.read_text())
        if split not in self.index["splits"]:
            raise ValueError(f"{f}: no split {split!r} (has {sorted(self.index['splits'])})")
        dtype = np.dtype(self.index["dtype"])
        self.maps: list[np.memmap] = []
        for s in self.index["splits"][split]["shards"]:
            path = self.folder / s["file"]
            if not path.exists():
                raise FileNotFoundError(f"{path}: shard listed in {INDEX} is missing")
            if path.stat().st_size != s["tokens"] * dtype.itemsize:
                raise ValueError(f"{path}: size {path.stat().st_size} bytes, index says {s['tokens']} tokens of {dtype}")
            if s["tokens"]:
                self.maps.append(np.memmap(path, dtype=dtype, mode="r"))
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])
        self.vocab_size: int = self.index["vocab_size"]
        self.eos_token_id: int | None = self.index.get("eos_token_id")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start+n) as int64 (crossing shard boundaries as needed)."""
        if start < 0 or start + n > len(self):
            raise IndexError(f"tokens [{start}, {start + n}) outside a split of {len(self)}")
        out = np.empty(n, dtype=np.int64)
        i = int(np.searchsorted(self.starts, start, side="right") - 1)
        done = 0
        while done < n:
            off = start + done - int(self.starts[i])
            take = min(n - done, len(self.maps[i]) - off)
            out[done:done + take] = self.maps[i][off:off + take]
            done += take
            i += 1
        return out


FREQUENCIES = "token_frequencies.json"


def token_counts(shards: TokenShards, vocab_size: int, chunk: int = 1 << 22) -> np.ndarray:
    """How often each token id occurs in a split: int64 [vocab_size]."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(shards), chunk):
        counts += np.bincount(shards.read(start, min(chunk, len(shards) - start)), minlength=vocab_size)[:vocab_size]
    return counts


def write_token_frequencies(folder: str | Path, split: str = "train") -> Path:
    """Write `token_frequencies.json` (the split's token counts) into a data folder; the trainer copies it beside
    the models it writes, where reduced-vocabulary drafting (`--draft-vocab N`) reads it."""
    folder = Path(folder)
    shards = TokenShards(folder, split)
    vocab = json.loads((folder / INDEX).read_text())["vocab_size"]
    counts = token_counts(shards, vocab)
    path = folder / FREQUENCIES
    path.write_text(json.dumps({"split": split, "tokens": int(counts.sum()), "counts": counts.tolist()}) + "\n")
    return path
