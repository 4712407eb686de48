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
    """Where the T tokens of one forward sit: positions start..start+T-1 (every batch row alike), with the
    rotary tables the family computed for them (cos/sin [T, R]; None for a family without RoPE).
    `router_logits`: when a list, every MoE layer of this forward appends its router logits [B*T, E] to it."""

    start: int
    length: int
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    router_logits: list | None = None


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


@dataclass
class Verified:
    """A verify forward of q tokens from position `start`: hidden [B, q, H] and, per layer, the snapshot that
    rollback needs (None for layers whose state is addressed by position)."""

    hidden: torch.Tensor
    start: int
    snapshots: list[DeltaSnapshot | None]

    @property
    def length(self) -> int:
        return self.hidden.shape[1]


class Cache:
    """Per-layer decode state of one batch of sequences; `pos` = tokens already consumed."""

    def __init__(self, layers: list, max_len: int):
        self.layers = layers
        self.max_len = max_len
        self.pos = 0

    def check_room(self, n: int) -> None:
        if self.pos + n > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions; cannot add {n} at position {self.pos}")

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
