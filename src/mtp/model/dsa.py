"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): MLA where each query attends only to the `index_topk` keys a
lightning indexer chooses (docs/families.md, "DeepSeek-V3.2 and GLM-5").

The indexer (`self_attn.indexer`, checkpoint names): index queries `wq_b(query latent)` [Hi heads x Di], one index
key per token `k_norm(wk(x))` [Di] (a LayerNorm with bias, eps 1e-6), RoPE on the first `qk_rope_head_dim` dims of
both (halves rotated for DeepSeek-V3.2, interleaved pairs for GLM-5: `indexer_rope_interleave`), and head weights
`weights_proj(x) * Hi^-1/2`. The score of key j for query t, in fp32:

    I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j] * Di^-1/2)

Query t keeps the `index_topk` best-scored keys among those it may see (positions <= its own), every one of them
when it sees at most `index_topk` (then it is dense attention). Ties at the k-th score go to the earlier keys
(`select_keys`): the choice depends only on the query's own scores, never on the batch, the width of a verify or the
cache length, so a verify row chooses exactly the keys its plain decoding step chooses. The choice only masks the
attention; no gradient flows into the indexer (transformers runs it under no_grad; DeepSeek trains it with its own
KL loss, which `mtp` does not implement).

Decode state (`IndexedKVCache`): the MLA keys/values plus each position's index key [B, S, Di], all addressed by
position, so a verify's rejected positions are overwritten before they are read: nothing to roll back. GLM-5's
IndexShare layers have no indexer and reuse the choice of the last full layer before them
(`Positions.key_selection`, keyed by layer, so a recomputed layer under gradient checkpointing reads the right one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DeepseekV32Config
from .cache import KVCache, Positions
from .mla import MLAttention
from .rope import apply_rope, apply_rope_interleaved

INDEX_KEY_NORM_EPS = 1e-6  # transformers' indexer LayerNorm (not a config key)


@dataclass
class IndexedKVCache(KVCache):
    """A sparse-attention layer's decode state: K/V [B, A, S, D] and the index keys ik [B, S, Di]."""

    ik: torch.Tensor

    @classmethod
    def allocate_indexed(cls, batch: int, heads: int, max_len: int, k_dim: int, v_dim: int, index_dim: int,
                         dtype: torch.dtype, device: torch.device | str) -> IndexedKVCache:
        kv = KVCache.allocate(batch, heads, max_len, k_dim, v_dim, dtype, device)
        return cls(kv.k, kv.v, torch.zeros(batch, max_len, index_dim, dtype=dtype, device=device))

    def write_index(self, ik: torch.Tensor, start: int) -> torch.Tensor:
        """Store index keys [B, T, Di] at positions start..start+T-1; return those of positions 0..start+T-1 (a view)."""
        end = start + ik.shape[1]
        self.ik[:, start:end] = ik
        return self.ik[:, :end]

    def write_index_at(self, ik: torch.Tensor, index: torch.Tensor) -> None:
        """Store index keys [B, T, Di] at positions index [B, T] (a tensor: static shapes, no host sync)."""
        rows = torch.arange(ik.shape[0], device=ik.device)[:, None].expand_as(index)
        self.ik[rows, index] = ik.to(self.ik.dtype)

    def rows(self, lo: int, hi: int) -> IndexedKVCache:
        return IndexedKVCache(self.k[lo:hi], self.v[lo:hi], self.ik[lo:hi])

    def snapshot(self, row: int, n: int) -> IndexedKVCache:
        kv = super().snapshot(row, n)
        return IndexedKVCache(kv.k, kv.v, self.ik[row:row + 1, :n].clone())

    def restore(self, row: int, snap: IndexedKVCache) -> None:
        super().restore(row, snap)
        self.ik[row:row + 1, :snap.ik.shape[1]] = snap.ik


def select_keys(scores: torch.Tensor, allowed: torch.Tensor | None, k: int) -> torch.Tensor:
    """The keys each query keeps: scores [..., S] (fp32) and allowed [..., S] bool (None: all) -> [..., S] bool.

    The k best allowed keys by score; every allowed key when there are at most k; among keys tied at the k-th score
    the earliest (what a stable sort by descending score keeps). Defined by the query's own scores alone: the same
    keys whatever S (slots past the allowed ones), the batch or the other queries."""
    if allowed is None:
        allowed = torch.ones_like(scores, dtype=torch.bool)
    if scores.shape[-1] <= k:
        return allowed.clone()
    masked = scores.masked_fill(~allowed, float("-inf"))
    kth = masked.topk(k, dim=-1).values[..., -1:]  # the k-th best score (-inf when fewer than k are allowed)
    above = masked > kth
    tied = (masked == kth) & allowed
    room = k - above.sum(-1, keepdim=True)  # how many tied keys still fit
    return above | (tied & (tied.cumsum(-1) <= room))


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """I = sum_h w_h relu(q_h . k * scale): q [B, T, Hi, Di], w [B, T, Hi] fp32, k [B, S, Di] -> [B, T, S] fp32 (as
    transformers computes it: two matmuls)."""
    s = F.relu(torch.matmul(q.float(), k.float().transpose(-1, -2)[:, None]) * scale)  # [B, T, Hi, S]
    return torch.matmul(w[:, :, None, :], s)[:, :, 0]


def index_scores_masked(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """`index_scores` written as sums (no matmul, whose blocking may depend on the sizes): what a compiled decode
    forward computes over all S slots. q [B, T, Hi, Di], w [B, T, Hi], k [B, S, Di] -> [B, T, S] fp32."""
    s = F.relu((q.float()[:, :, :, None, :] * k.float()[:, None, None, :, :]).sum(-1) * scale)  # [B, T, Hi, S]
    return (w[..., None] * s).sum(2)


class LightningIndexer(nn.Module):
    """`self_attn.indexer`: `wq_b` [Hi * Di, q_lora_rank], `wk` [Di, H], `k_norm` (LayerNorm [Di] with bias),
    `weights_proj` [Hi, H]."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, interleave: bool):
        super().__init__()
        self.heads, self.head_dim, self.interleave = heads, head_dim, interleave
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=INDEX_KEY_NORM_EPS)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)
        self.scale = head_dim**-0.5

    def rope(self, x: torch.Tensor, pos: Positions) -> torch.Tensor:
        """RoPE on the first R dims (R = the rotary table's width) of x [B, T, N, Di] -> [B, T, N, Di]."""
        xt = x.transpose(1, 2)  # [B, N, T, Di], the layout the rotary helpers take
        if self.interleave:
            r = pos.cos.shape[-1]
            xt = torch.cat([apply_rope_interleaved(xt[..., :r], pos.cos, pos.sin), xt[..., r:]], dim=-1)
        else:
            xt = apply_rope(xt, pos.cos, pos.sin)
        return xt.transpose(1, 2)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, pos: Positions) -> tuple[torch.Tensor, ...]:
        """x [B, T, H] and the query latent [B, T, q_lora_rank] -> index queries [B, T, Hi, Di], head weights
        [B, T, Hi] (fp32, times Hi^-1/2) and index keys [B, T, Di]."""
        B, T, _ = x.shape
        q = self.rope(self.wq_b(q_latent).view(B, T, self.heads, self.head_dim), pos)
        k = self.rope(self.k_norm(self.wk(x))[:, :, None], pos)[:, :, 0]
        w = self.weights_proj(x).float() * self.heads**-0.5
        return q, w, k


class SparseMLAttention(MLAttention):
    """`self_attn` of DeepSeek-V3.2 / GLM-5: DeepSeek-V3's MLA (`mla.py`) plus `indexer` (`LightningIndexer`) when the
    layer chooses its keys itself; a GLM-5 IndexShare layer ("shared") has none and uses the choice of layer
    `source` (the last full layer before it)."""

    def __init__(self, config: DeepseekV32Config, layer: int, source: int):
        super().__init__(config)
        c = config
        self.layer, self.source, self.index_topk = layer, source, c.index_topk
        self.indexer = (LightningIndexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim,
                                         c.indexer_rope_interleave) if source == layer else None)

    def forward(self, x: torch.Tensor, pos: Positions, cache: KVCache | None = None) -> tuple[torch.Tensor, None]:
        """x [B, T, H] at positions pos -> ([B, T, H], None); writes K/V (and index keys) into `cache` at those
        positions and records this layer's key choice in `pos.key_selection`."""
        B, T, _ = x.shape
        q, k, v, latent = self.project(x, pos)
        if pos.decoding:
            cache.write_at(k, v, pos.index)
        elif cache is not None:
            k, v = cache.write(k, v, pos.start)  # positions 0..start+T-1
        if self.indexer is not None:
            with torch.no_grad():
                chosen = self.choose(x, latent, pos, cache)
            pos.key_selection = {**(pos.key_selection or {}), self.layer: chosen}
        else:
            chosen = pos.key_selection[self.source]
        if not pos.decoding:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=chosen[:, None], scale=self.scale)
        elif pos.starts is not None and not torch.compiler.is_compiling():
            out = attend_chosen_rows(q, cache.k, cache.v, chosen, pos.starts, self.scale)
        else:
            out = attend_chosen_masked(q, cache.k, cache.v, chosen, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_dim)), None

    def choose(self, x: torch.Tensor, latent: torch.Tensor, pos: Positions, cache: IndexedKVCache | None) -> torch.Tensor:
        """The keys each query of x [B, T, H] keeps -> [B, T, S] bool over the S keys the attention reads (the cache's
        slots in a decode forward, positions 0..start+T-1 otherwise)."""
        B, T, _ = x.shape
        q, w, k = self.indexer(x, latent, pos)
        scale, topk = self.indexer.scale, self.index_topk
        if not pos.decoding:
            keys = k if cache is None else cache.write_index(k, pos.start)
            S = keys.shape[1]
            allowed = torch.arange(S, device=x.device)[None, :] <= torch.arange(T, device=x.device)[:, None] + (S - T)
            return select_keys(index_scores(q, w, keys, scale), allowed.expand(B, T, S), topk)
        cache.write_index_at(k, pos.index)
        keys = cache.ik
        S = keys.shape[1]
        if pos.starts is not None and not torch.compiler.is_compiling():
            # each query on its own, over exactly the keys it sees: the shapes (and so the arithmetic) of its plain step
            chosen = torch.zeros(B, T, S, dtype=torch.bool, device=x.device)
            for b, start in enumerate(pos.starts):
                for t in range(T):
                    n = start + t + 1
                    scores = index_scores(q[b, t][None, None].clone(), w[b, t][None, None].clone(), keys[b : b + 1, :n],
                                          scale)
                    chosen[b, t, :n] = select_keys(scores[0, 0], None, topk)
            return chosen
        allowed = torch.arange(S, device=x.device) <= pos.index[..., None]  # [B, T, S]
        return select_keys(index_scores_masked(q, w, keys, scale), allowed, topk)

    def new_state(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        qk = self.nope + self.rope
        if self.indexer is None:
            return KVCache.allocate(batch, self.num_heads, max_len, qk, self.v_dim, dtype, device)
        return IndexedKVCache.allocate_indexed(batch, self.num_heads, max_len, qk, self.v_dim, self.indexer.head_dim,
                                               dtype, device)


def attend_chosen_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chosen: torch.Tensor, starts: list[int],
                       scale: float) -> torch.Tensor:
    """Eager decode: query t of row b (position starts[b] + t) over keys 0..starts[b]+t of the cache k/v [B, A, S, D],
    masked to its chosen keys, one query at a time (exactly its plain step). q [B, A, T, D] -> [B, A, T, Dv]."""
    rows = []
    for b, start in enumerate(starts):
        outs = []
        for t in range(q.shape[2]):
            n = start + t + 1
            mask = chosen[b, t, :n][None, None, None, :]
            outs.append(F.scaled_dot_product_attention(q[b : b + 1, :, t : t + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n],
                                                       attn_mask=mask, scale=scale))
        rows.append(torch.cat(outs, dim=2))
    return torch.cat(rows)


def attend_chosen_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chosen: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Compiled decode: q [B, A, T, D] over all S slots of k/v [B, A, S, D], the keys not chosen ([B, T, S] bool)
    masked to exact zeros; fp32 sums (no matmul: `attention.attend_masked`). -> [B, A, T, Dv] in q's dtype."""
    scores = (q.float()[:, :, :, None, :] * k.float()[:, :, None, :, :]).sum(-1) * scale  # [B, A, T, S]
    probs = torch.softmax(scores.masked_fill(~chosen[:, None], float("-inf")), dim=-1)
    return (probs[..., None] * v.float()[:, :, None, :, :]).sum(-2).to(q.dtype)
