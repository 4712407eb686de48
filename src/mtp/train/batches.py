"""Deterministic batches from packed shards: the data position is the step number, so resume is exact.

The train stream is cut into non-overlapping windows of `seq_len` tokens; epoch e visits them in a
permutation seeded by (seed, e). Global sequence k of the run is window perm_{k // n}[k % n]. Step s with
global batch G takes sequences s*G .. s*G+G-1; rank r of W takes every W-th of them (so W processes see
exactly the sequences one process would, for the same global batch).
"""

from __future__ import annotations

import numpy as np
import torch

from ..data.shards import TokenShards


class Batches:
    def __init__(self, shards: TokenShards, seq_len: int, seed: int = 0):
        self.shards, self.seq_len, self.seed = shards, seq_len, seed
        self.n = len(shards) // seq_len
        if self.n < 1:
            raise ValueError(f"{shards.folder}: {len(shards)} tokens is less than one sequence of {seq_len}")
        self._perm: tuple[int, np.ndarray] | None = None

    def window(self, k: int) -> int:
        epoch, j = divmod(k, self.n)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n))
        return int(self._perm[1][j])

    def sequences(self, ks: list[int]) -> torch.Tensor:
        """ids [len(ks), seq_len] for global sequence numbers ks."""
        rows = [self.shards.read(self.window(k) * self.seq_len, self.seq_len) for k in ks]
        return torch.from_numpy(np.stack(rows))

    def micro_batch(self, step: int, micro: int, micro_batch: int, accum: int, rank: int = 0, world: int = 1):
        """ids [micro_batch, seq_len]: micro-batch `micro` (of `accum`) of `rank` at optimizer step `step`."""
        G = micro_batch * accum * world
        start = step * G
        mine = list(range(start + rank, start + G, world))          # this rank's share of the global batch
        return self.sequences(mine[micro * micro_batch:(micro + 1) * micro_batch])

    def fixed(self, n_seqs: int, batch: int) -> list[torch.Tensor]:
        """Evaluation batches: `n_seqs` windows spread evenly over the split, in order (no shuffling)."""
        n_seqs = min(n_seqs, self.n)
        idx = np.linspace(0, self.n - 1, n_seqs).round().astype(int)
        rows = [self.shards.read(int(i) * self.seq_len, self.seq_len) for i in idx]
        t = torch.from_numpy(np.stack(rows))
        return list(t.split(batch))
