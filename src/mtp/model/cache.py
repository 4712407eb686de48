"""Decode state, addressed so that rolling a speculative round back never recomputes anything.

- `KVCache`: attention keys/values preallocated for `max_len` positions and addressed by position, so rolling back
  is only not advancing the position (entries past it are overwritten before they are read).
- `DeltaState`: a Gated DeltaNet layer's conv inputs and recurrent state. A decode forward of T tokens per row
  (`CausalLM.decode`) leaves it as it was and returns `DeltaSteps` (the conv window and the state before and after
  each token); `Cache.keep_at(steps, n)` then selects each row's state after its first n tokens.
- `Cache`: the per-layer states of a batch of rows and each row's position on the host (`rows`); a single-row view
  (`view`) is what a prefill reads a prompt into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import deltanet_kernel


@dataclass
class Positions:
    """Where the T tokens of one forward sit, with the rotary tables the family computed for them (None for a family
    without RoPE). A prefill or training forward: positions start..start+T-1 of every batch row (cos/sin [T, R]). A
    decode forward (`decoding`): `index` [B, T] (long, on the device) holds every token's position (cos/sin
    [B, 1, T, R]), and `starts` optionally each row's first position on the host (eager attention then reads exactly
    each row's keys). `router_logits`: when a list, every MoE layer of this forward appends its router logits
    [B*T, E] to it. `key_selection`: layer index -> the keys that sparse-attention layer's indexer chose for each
    query, [B, T, S] bool (GLM-5's IndexShare layers reuse an earlier layer's; `dsa.py`). `rotary_by_kind`: for a
family whose layer kinds use different RoPE tables (MiMo-V2-Flash: global vs sliding-window attention), layer kind
-> (cos, sin) shaped as `cos` / `sin`; None: every layer reads `cos` / `sin`. `commit`: a decode forward of one token
per row that every row keeps (a plain step, known before the forward): recurrent layers may then update their state
in place and return no steps for `Cache.keep_at` (which must then keep 1 for every row)."""

    start: int
    length: int
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    router_logits: list | None = None
    starts: list[int] | None = None
    index: torch.Tensor | None = None
    key_selection: dict[int, torch.Tensor] | None = None
    rotary_by_kind: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    commit: bool = False

    @property
    def decoding(self) -> bool:
        """A decode forward (static shapes, positions in `index`): mixers take their decode path."""
        return self.index is not None


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

    def write_at(self, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
        """Store k, v [B, Hk, T, D] at positions index [B, T] (a tensor: no host synchronisation, static shapes)."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None].expand_as(index)
        self.k[rows, :, index] = k.transpose(1, 2).to(self.k.dtype)  # advanced indices first: [B, T, Hk, D]
        self.v[rows, :, index] = v.transpose(1, 2).to(self.v.dtype)

    def rows(self, lo: int, hi: int) -> KVCache:
        """Rows lo..hi-1 (views: writes go to this cache)."""
        return KVCache(self.k[lo:hi], self.v[lo:hi])

    def reset_row(self, b: int) -> None:
        """Nothing to clear: entries are addressed by position and written before they are read."""

    def snapshot(self, row: int, n: int) -> KVCache:
        """Row `row`'s entries of positions 0..n-1, copied: [1, Hk, n, D] (`decode/prompt_cache.py`)."""
        return KVCache(self.k[row:row + 1, :, :n].clone(), self.v[row:row + 1, :, :n].clone())

    def restore(self, row: int, snap: KVCache) -> None:
        """Row `row`'s first positions := a snapshot's."""
        n = snap.k.shape[2]
        self.k[row:row + 1, :, :n] = snap.k
        self.v[row:row + 1, :, :n] = snap.v


@dataclass
class DeltaSteps:
    """What a decode forward of T tokens per row keeps for one Gated DeltaNet layer, so that `DeltaState.keep_at` can
    set the state after any n in 1..T (n = 0: the cache's own, which the forward did not change): the conv window, and
    either each token's update of the recurrent state (the C step, deltanet.c: its key, delta and decay, which the keep
    applies again with the step's own arithmetic - at real size a layer's state is a megabyte, T of them were written
    by every verify) or the state after each token (the torch form)."""

    window: torch.Tensor  # [B, C, kernel-1+T]
    updates: torch.Tensor | None = None  # [B, Hv, T, Kd + Vd + 1] fp32: token t's key [Kd], delta [Vd], decay [1]
    states: torch.Tensor | None = None  # [B, H, T, Kd, Vd] fp32; states[:, :, t] is the state after token t


@dataclass
class DeltaState:
    conv: torch.Tensor  # [B, C, kernel-1]: the last conv inputs
    ssm: torch.Tensor  # [B, Hv, Kd, Vd], fp32

    def keep_at(self, steps: DeltaSteps, n: torch.Tensor) -> None:
        """Row b := its state after its first n[b] (0..T) positions of a decode forward; n [B] long, on the device."""
        if steps.updates is not None:
            tensors = (self.ssm, self.conv, steps.updates, steps.window)
            if deltanet_kernel.usable(*tensors, n):  # the kept updates applied, the state read and written once
                whole = [t.contiguous() for t in tensors]  # (the keep's fused multiply-adds are the step's: torch has
                deltanet_kernel.keep(*whole, n)           # no exact one, so a strided state goes through copies)
                for t, w in zip(tensors[:2], whole[:2]):
                    if w is not t:
                        t.copy_(w)
                return
            self._replay(steps.updates, n)
        else:
            self._keep_state(steps, n)
        width = self.conv.shape[-1]
        idx = (n[:, None, None] + torch.arange(width, device=n.device)).expand(-1, self.conv.shape[1], -1)
        self.conv.copy_(steps.window.gather(2, idx))

    def _replay(self, updates: torch.Tensor, n: torch.Tensor) -> None:
        # deltanet_keep's arithmetic in torch where its kernel cannot run (S * g + k * d: not its bits, which fuse the
        # last multiply-add; the updates come from the C step, so this is for a caller outside the decode paths)
        Kd, Vd = self.ssm.shape[-2:]
        S = self.ssm
        for t in range(updates.shape[2]):
            u = updates[:, :, t]
            step = S * u[..., Kd + Vd, None, None] + u[..., :Kd, None] * u[..., None, Kd:Kd + Vd]
            S = torch.where((n > t)[:, None, None, None], step, S)
        self.ssm.copy_(S)

    def _keep_state(self, steps: DeltaSteps, n: torch.Tensor) -> None:
        # [B, H, Kd, Vd]; one token per row (a plain step): a view, not a gather (a slow copy of megabytes at real size)
        if steps.states.shape[2] == 1:
            after = steps.states[:, :, 0]
        else:
            after = steps.states[torch.arange(n.shape[0], device=n.device), :, (n - 1).clamp(min=0)]
        # no copy of the state before the forward was made (megabytes per layer at real size): a row that keeps
        # nothing keeps its own
        self.ssm.copy_(torch.where((n > 0)[:, None, None, None], after, self.ssm))

    def rows(self, lo: int, hi: int) -> DeltaState:
        return DeltaState(self.conv[lo:hi], self.ssm[lo:hi])

    def contiguous(self) -> bool:
        """Can the C step update this state in place (both tensors contiguous)?"""
        return self.conv.is_contiguous() and self.ssm.is_contiguous()

    def reset_row(self, b: int) -> None:
        """Row b starts a new sequence: no conv inputs, zero state."""
        self.conv[b].zero_()
        self.ssm[b].zero_()

    def snapshot(self, row: int, n: int) -> DeltaState:
        """Row `row`'s state (after its n positions: the state holds no positions), copied."""
        return DeltaState(self.conv[row:row + 1].clone(), self.ssm[row:row + 1].clone())

    def restore(self, row: int, snap: DeltaState) -> None:
        self.conv[row:row + 1] = snap.conv
        self.ssm[row:row + 1] = snap.ssm


class Cache:
    """Per-layer decode state of a batch of rows. `pos`: tokens consumed by a single-sequence cache (a prefill);
    `rows`: each row's position on the host, for a batch decoded by rounds (the decoder keeps it)."""

    def __init__(self, layers: list, max_len: int, rows: list[int] | None = None):
        self.layers = layers
        self.max_len = max_len
        self.pos = 0
        self.rows = rows

    def view(self, lo: int, hi: int) -> Cache:
        """Rows lo..hi-1 as a cache of their own (views of the same memory); a single row continues at its position as
        a single-sequence cache (write it back with `sync`), several rows share this cache's `rows`."""
        view = Cache([layer.rows(lo, hi) for layer in self.layers], self.max_len, None if hi - lo == 1 else self.rows)
        if hi - lo == 1:
            view.pos = self.rows[lo]
        return view

    def sync(self, view: Cache, row: int) -> None:
        """Take a single-row view's position back into this cache's rows."""
        self.rows[row] = view.pos

    def reset_row(self, b: int) -> None:
        """Row b starts a new sequence at position 0."""
        for layer in self.layers:
            layer.reset_row(b)
        self.rows[b] = 0

    def snapshot(self, row: int, n: int) -> list:
        """Row `row` after its first n positions, every layer's state copied (`decode/prompt_cache.py`)."""
        return [layer.snapshot(row, n) for layer in self.layers]

    def restore(self, row: int, snaps: list, n: int) -> None:
        """Row `row` := a snapshot of n positions; the row continues at position n."""
        for layer, snap in zip(self.layers, snaps):
            layer.restore(row, snap)
        self.rows[row] = n

    def check_room(self, n: int) -> None:
        if self.pos + n > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions; cannot add {n} at position {self.pos}")

    def keep_at(self, steps: list, n: torch.Tensor) -> None:
        """After a decode forward (`CausalLM.decode`): keep each row's first n[b] tokens (n [B] long on the device, 0
        for a row that keeps nothing). Recurrent states are selected from the steps; attention entries are addressed by
        position and need nothing. Positions are the caller's (`rows` on the host, the round's tensors)."""
        kept = [(state, st) for state, st in zip(self.layers, steps) if st is not None]
        if not kept or (all(type(s) is DeltaState for s, _ in kept) and deltanet_kernel.keep_layers(kept, n)):
            return  # (the Gated DeltaNet layers of one forward: one C call)
        for state, st in kept:
            state.keep_at(st, n)
