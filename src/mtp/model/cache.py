"""Decode state, and what one verify forward returns so that rollback never recomputes.

- `KVCache`: attention keys/values preallocated for `max_len` positions and addressed by position, so
  rolling back is only moving `Cache.pos` (entries past it are overwritten later).
- `DeltaState`: a Gated DeltaNet layer's conv inputs and recurrent state. A verify forward of q tokens
  returns a `DeltaSnapshot` per such layer (the conv window and every position's state);
  `Cache.keep(verified, n)` selects the state after the n-th position.
- `Verified`: the hidden states of a verify forward and the snapshots; nothing is left on the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Positions:
    """Where the T tokens of one forward sit: positions start..start+T-1 of every batch row, or with `starts` (a
    batch of sequences at different places: continuous batching) starts[b]..starts[b]+T-1 for row b; with the rotary
    tables the family computed for them (cos/sin [T, R], or [B, 1, T, R] per row; None for a family without RoPE).
    `router_logits`: when a list, every MoE layer of this forward appends its router logits [B*T, E] to it."""

    start: int
    length: int
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    router_logits: list | None = None
    starts: list[int] | None = None


@dataclass
class KVCache:
    k: torch.Tensor  # [B, Hk, S, Dk]
    v: torch.Tensor  # [B, Hk, S, Dv]

    @classmethod
    def allocate(cls, batch: int, heads: int, max_len: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> KVCache:
        return cls(torch.zeros(batch, heads, max_len, k_dim, dtype=dtype, device=device),
                   torch.zeros(batch, heads, max_len, v_dim, dtype=dtype, device=device))

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hk, T, D] at positions start..start+T-1; return the keys/values of positions
        0..start+T-1 (views, no copy)."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def write_rows(self, k: torch.Tensor, v: torch.Tensor, starts: list[int]) -> None:
        """Store row b of k, v [B, Hk, T, D] at positions starts[b]..starts[b]+T-1."""
        T = k.shape[2]
        for b, s in enumerate(starts):
            self.k[b, :, s : s + T] = k[b]
            self.v[b, :, s : s + T] = v[b]

    def rows(self, lo: int, hi: int) -> KVCache:
        """Rows lo..hi-1 (views: writes go to this cache)."""
        return KVCache(self.k[lo:hi], self.v[lo:hi])

    def reset_row(self, b: int) -> None:
        """Nothing to clear: entries are addressed by position and written before they are read."""

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Row dst := row src over positions 0..length-1."""
        self.k[dst, :, :length] = self.k[src, :, :length]
        self.v[dst, :, :length] = self.v[src, :, :length]


@dataclass
class DeltaSnapshot:
    """What a verify forward of q tokens keeps for one Gated DeltaNet layer: the conv window and the recurrent state
    after every verified position."""

    window: torch.Tensor  # [B, C, kernel-1+q]: the conv inputs before and of the q tokens
    states: torch.Tensor  # [B, H, q, Kd, Vd] fp32

    def state(self, n: int) -> torch.Tensor:
        """The recurrent state after the first n (>= 1) positions: [B, H, Kd, Vd]."""
        return self.states[:, :, n - 1]


@dataclass
class DeltaState:
    conv: torch.Tensor  # [B, C, kernel-1]: the last conv inputs
    ssm: torch.Tensor  # [B, Hv, Kd, Vd], fp32

    def restore(self, snap: DeltaSnapshot, n: int) -> None:
        """Make this the state after the first n (>= 1) of the snapshot's q positions (selected, not recomputed)."""
        width = self.conv.shape[-1]
        self.conv.copy_(snap.window[:, :, n : n + width])
        self.ssm.copy_(snap.state(n))

    def restore_rows(self, snap: DeltaSnapshot, ns: list[int]) -> None:
        """Row b := its state after its first ns[b] positions (batched verify with a length per row)."""
        width = self.conv.shape[-1]
        q = snap.states.shape[2]
        for b, n in enumerate(ns):
            if n < q:
                self.conv[b].copy_(snap.window[b, :, n : n + width])
                self.ssm[b].copy_(snap.states[b, :, n - 1])

    def rows(self, lo: int, hi: int) -> DeltaState:
        return DeltaState(self.conv[lo:hi], self.ssm[lo:hi])

    def reset_row(self, b: int) -> None:
        """Row b starts a new sequence: no conv inputs, zero state."""
        self.conv[b].zero_()
        self.ssm[b].zero_()

    def copy_row(self, src: int, dst: int, length: int) -> None:
        self.conv[dst] = self.conv[src]
        self.ssm[dst] = self.ssm[src]


@dataclass
class Verified:
    """A verify forward of q tokens from position `start`: hidden [B, q, H] and, per layer, the snapshot that
    rollback needs (None for layers whose state is addressed by position)."""

    hidden: torch.Tensor
    start: int
    snapshots: list[DeltaSnapshot | None]
    starts: list[int] | None = None  # per row, for a batch at different positions

    @property
    def length(self) -> int:
        return self.hidden.shape[1]


class Cache:
    """Per-layer decode state of one batch of sequences; `pos` = tokens already consumed. For a batch of sequences
    at different positions (continuous batching) `rows` holds each row's position instead (`pos` is unused)."""

    def __init__(self, layers: list, max_len: int, rows: list[int] | None = None):
        self.layers = layers
        self.max_len = max_len
        self.pos = 0
        self.rows = rows

    def view(self, lo: int, hi: int) -> Cache:
        """Rows lo..hi-1 as a cache of their own (views of the same memory); a single row (hi = lo + 1) continues at
        its position as a plain cache, several rows keep per-row positions. Write positions back with `sync`."""
        view = Cache([layer.rows(lo, hi) for layer in self.layers], self.max_len,
                     None if hi - lo == 1 else list(self.rows[lo:hi]))
        if hi - lo == 1:
            view.pos = self.rows[lo]
        return view

    def sync(self, view: Cache, lo: int) -> None:
        """Take a view's positions back into this cache's rows."""
        if view.rows is None:
            self.rows[lo] = view.pos
        else:
            self.rows[lo : lo + len(view.rows)] = view.rows

    def reset_row(self, b: int) -> None:
        """Row b starts a new sequence at position 0."""
        for layer in self.layers:
            layer.reset_row(b)
        self.rows[b] = 0

    def copy_row(self, src: int, dst: int) -> None:
        """Row dst := row src (moving a sequence to another row)."""
        for layer in self.layers:
            layer.copy_row(src, dst, self.rows[src])
        self.rows[dst] = self.rows[src]

    def check_room(self, n: int) -> None:
        last = self.pos if self.rows is None else max(self.rows)
        if last + n > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions; cannot add {n} at position {last}")

    def keep(self, verified: Verified, n: int) -> None:
        """Keep the first n (1 <= n <= q) positions of a verify forward and roll the others back: DeltaNet
        states are selected from the snapshots, attention entries past the new `pos` are overwritten later."""
        q = verified.length
        if not 1 <= n <= q:
            raise ValueError(f"keep({n}) after a verify of {q} tokens")
        if self.pos != verified.start + q:
            raise ValueError(f"keep(): the cache is at position {self.pos}, the verify ended at {verified.start + q}")
        if n < q:
            for state, snap in zip(self.layers, verified.snapshots):
                if snap is not None:
                    state.restore(snap, n)
        self.pos = verified.start + n

    def keep_rows(self, verified: Verified, ns: list[int]) -> None:
        """`keep` for a batch verified at per-row positions: row b keeps its first ns[b] positions."""
        q = verified.length
        if any(not 1 <= n <= q for n in ns):
            raise ValueError(f"keep_rows({ns}) after a verify of {q} tokens")
        for state, snap in zip(self.layers, verified.snapshots):
            if snap is not None:
                state.restore_rows(snap, ns)
        self.rows = [s + n for s, n in zip(verified.starts, ns)]
