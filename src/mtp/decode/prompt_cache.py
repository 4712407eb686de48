"""Prompt caching: a row's state after the first n tokens of a prompt, kept to be read again by later requests.

A server sees the same prompts again and again (a system prompt, a conversation's earlier turns, retries, n > 1
samples). The decoder (`decoder.py`) reads prompts in chunks of PREFILL_CHUNK tokens from position 0, so the state
after n tokens is the same bits whatever follows them when n is a multiple of the chunk (or the whole prompt): a
later prompt that starts with those n tokens can take that state and read only the rest, with every number it
computes equal to a cold read's (greedy output unchanged, tested). A snapshot holds, for one row:
  - every backbone layer's state after n positions (attention keys/values of positions 0..n-1, a Gated DeltaNet
    layer's conv inputs and recurrent state; `Cache.snapshot`),
  - every MTP layer's entries of positions 0..n-2 (the MTP reads position i with the token after it, so position
    n-1 waits for the next chunk or the first token) and the backbone's hidden state at n-1 (`carry`).
The decoder keeps two a prompt: after its whole prompt (the same prompt again reads nothing) and after its last whole
chunk before the end (a prompt that extends it, as a conversation's next turn does, reads at most a chunk again plus
what is new). Least recently used snapshots go first when the bytes exceed the budget; a snapshot larger than the
budget is not kept.

Keys hash the prompt chunk by chunk (a chain of hashes, so a lookup reads the prompt once); a hit is then checked
against the snapshot's own tokens, so a hash collision can only cost a miss.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .prefill import PREFILL_CHUNK


@dataclass
class Snapshot:
    """A row after the first n tokens of a prompt (see the module docstring)."""

    tokens: list[int]  # the n tokens
    backbone: list  # `Cache.snapshot`: each backbone layer's state
    mtp: list | None  # each MTP layer's entries of positions 0..n-2 (None: a decoder without MTP took it)
    carry: torch.Tensor  # [H]: the backbone's hidden state at position n-1
    nbytes: int = 0

    def __post_init__(self) -> None:
        states = self.backbone + (self.mtp or [])
        self.nbytes = self.carry.nbytes + sum(t.nbytes for s in states for t in vars(s).values())

    @property
    def n(self) -> int:
        return len(self.tokens)


def prefix_keys(tokens: list[int], chunk: int) -> list[tuple[int, int]]:
    """(n, key) for n = chunk, 2 chunk, ... <= len(tokens), and for n = len(tokens): each key hashes tokens[:n]."""
    keys, h = [], 0
    for lo in range(0, len(tokens), chunk):
        part = tokens[lo:lo + chunk]
        h = hash((h, tuple(part)))
        keys.append((lo + len(part), h))
    return keys


class PromptCache:
    """Snapshots by prompt prefix, least recently used first out, within `max_bytes`, for one model (its decoders
    share it: a server's, or `generate(..., prompt_cache=)` calls). Snapshots are taken only where a cold read's
    chunks (PREFILL_CHUNK) end."""

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.chunk = PREFILL_CHUNK
        self.entries: OrderedDict[tuple[int, int], Snapshot] = OrderedDict()
        self.nbytes = 0
        self._model: weakref.ref | None = None  # the model whose states it holds (`bind`)

    def bind(self, model) -> None:
        """Hold `model`'s states from now on: a cache serves the model it first served (another's states do not fit)."""
        held = None if self._model is None else self._model()
        if held is not None and held is not model:
            raise ValueError("this PromptCache holds another model's states; give each model its own")
        if held is None:
            self.entries.clear()
            self.nbytes = 0
            self._model = weakref.ref(model)

    def lookup(self, prompt: list[int], mtp: bool) -> Snapshot | None:
        """The snapshot of the longest prefix of `prompt` a read can continue from: the whole prompt, or a multiple of
        the chunk shorter than it (`mtp`: one that holds the MTP's entries)."""
        for n, key in reversed(prefix_keys(prompt, self.chunk)):
            snap = self.entries.get((n, key))
            if snap is not None and snap.tokens == prompt[:n] and (snap.mtp is not None or not mtp):
                self.entries.move_to_end((n, key))
                return snap
        return None

    def wants(self, prompt: list[int], n: int) -> bool:
        """Keep a snapshot after n tokens of `prompt`? After the whole prompt, and after its last whole chunk before
        the end."""
        return self.max_bytes > 0 and 0 < n and (n == len(prompt) or (n % self.chunk == 0 and len(prompt) - n <= self.chunk))

    def store(self, snap: Snapshot) -> None:
        if snap.nbytes > self.max_bytes:
            return
        key = (snap.n, prefix_keys(snap.tokens, self.chunk)[-1][1])
        old = self.entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self.entries[key] = snap
        self.nbytes += snap.nbytes
        while self.nbytes > self.max_bytes:
            _, gone = self.entries.popitem(last=False)
            self.nbytes -= gone.nbytes
