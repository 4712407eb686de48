"""MTP self-speculative decoding, one round for B >= 1 sequences, top to bottom: draft, verify, accept, keep.

Output equals plain decoding (greedy: the same tokens; sampling: the same distribution). Row b of the batch holds
one sequence: the backbone consumed `pos[b]` tokens, `last[b]` (emitted, not yet consumed) is next. One round is:

  1. draft    - `draft()`: the MTP reads the positions the backbone kept last round (`pending`, paired with the token
                after each: exactly the teacher-forced depth-1 computation of training), which yields draft 1; drafts
                2..K follow the causal chain (parallel heads: all at once).
  2. verify   - `verify()`: ONE backbone forward over [last, d_1..d_K] for every row.
  3. accept   - `accept.py`, on the device: each row's accepted count n and its next token (`accept_and_keep`; on the
                CPU `round_kernel.py` emits and keeps them in one C call with the same result: greedy rows' whole
                steps 3-4, a sampling rule's tokens once the rule has chosen them).
  4. keep     - `cache.keep_at(steps, n + 1)`: attention entries are addressed by position (nothing to undo),
                Gated DeltaNet states are selected at the kept position, never recomputed; positions advance by n+1;
                the kept positions become the MTP's `pending` for the next round.

Everything is a tensor with a static shape and nothing synchronises with the host, so `draft` and `verify` can be
compiled or captured as graphs (`compiled.py`); the host reads one small tensor per round (the tokens and n). A
plain decoding step is the round with K = 0. Rows that are not decoding this round (`active` false: reading a prompt,
or empty) keep nothing: their positions and states do not move (garbage written past their position is overwritten
before it is read, like every slot past a sequence's end).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.argmax_kernel import argmax
from ..model.base import PickRule
from ..model.cache import Cache
from . import accept, round_kernel
from .sampling import RowSampling, shape_logits

# The most drafts one round makes; the MTP's pending positions (kept but not read) are held up to PENDING.
MAX_DRAFT = 8
PENDING = MAX_DRAFT + 1


@dataclass
class RoundState:
    """The decode state of `rows` sequences, on the model's device (allocated once per decoder)."""

    cache: Cache  # the backbone's
    pos: torch.Tensor  # [B] long: tokens the backbone consumed
    last: torch.Tensor  # [B] long: the last emitted token, consumed next round
    mtp_cache: list | None = None  # one per MTP layer
    mtp_pos: torch.Tensor | None = None  # [B] long: MTP slots filled (accepted (h_j, t_{j+1}) pairs)
    pend_h: torch.Tensor | None = None  # [B, PENDING, H]: kept positions the MTP has not read yet
    pend_next: torch.Tensor | None = None  # [B, PENDING] long: the token that follows each of them
    pend_n: torch.Tensor | None = None  # [B] long: how many
    seen: torch.Tensor | None = None  # [B, V] bool: the tokens so far (repetition penalty)

    @classmethod
    def allocate(cls, model, rows: int, max_len: int, mtp: bool, penalty: bool) -> RoundState:
        dev = model.device
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)  # noqa: E731
        st = cls(model.new_cache(rows, max_len, rows=True), zeros(rows), zeros(rows))
        if mtp:
            st.mtp_cache = model.new_mtp_cache(rows, max_len)
            st.mtp_pos, st.pend_n, st.pend_next = zeros(rows), zeros(rows), zeros(rows, PENDING)
            st.pend_h = torch.zeros(rows, PENDING, model.hidden_width, dtype=model.dtype, device=dev)
        if penalty:
            st.seen = torch.zeros(rows, model.config.vocab_size, dtype=torch.bool, device=dev)
        return st

    def restart(self) -> None:
        """A pooled state for a new decoder: the rows' positions and pending MTP inputs as `allocate` leaves them, so
        a padding row indexes within its buffers as a fresh one does. The caches are reset row by row as sequences
        take the rows (a padding row computes on whatever its caches hold and keeps nothing)."""
        with torch.inference_mode():  # (a state made in a generation's inference mode is an inference tensor's)
            for t in (self.pos, self.last, self.mtp_pos, self.pend_n, self.pend_next, self.pend_h):
                if t is not None:
                    t.zero_()

    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor (row moves copy each)."""
        out = [self.pos, self.last] + [t for layer in self.cache.layers for t in vars(layer).values()]
        if self.mtp_cache is not None:
            out += [self.mtp_pos, self.pend_h, self.pend_next, self.pend_n]
            out += [t for c in self.mtp_cache for t in vars(c).values()]
        if self.seen is not None:
            out.append(self.seen)
        return out


def seen_before(seen: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor | None:
    """seen [B, V] and drafts [B, K] -> [B, K+1, V]: the tokens before verify position j (seen and d_1..d_j)."""
    if seen is None:
        return None
    marks = torch.zeros(*drafts.shape, seen.shape[-1], dtype=torch.long, device=seen.device)
    marks.scatter_(2, drafts[..., None], 1)
    return torch.cat([seen[:, None], seen[:, None] | (marks.cumsum(1) > 0)], dim=1)


def draft(model, st: RoundState, K: int, rs: RowSampling | None, noise: torch.Tensor | None, vocab=None,
          width: int = PENDING, host: tuple[list[int], list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step 1: K drafts per row [B, K] (long) and, for the unseeded sampling rule, their draft logits [B, K, V]
    (the drafts' rule, `RowSampling.for_drafts`: the repetition penalty, temperature and top-k). `rs` None: every row
    greedy with no shaping (argmax drafts). `noise` [B, K, V]: Gumbel noise of the sampled rows' drafts. `width` (<= PENDING):
    how many pending positions to read (static in a graph; eagerly the most any row has). `host`: the rows' MTP
    positions and pending counts on the host (eager attention reads exactly each row's keys) or None."""
    starts = None if host is None else host[0]
    mtp = model.mtp
    B = st.pos.shape[0]
    dev = st.pos.device
    # The drafts' rule is the repetition penalty (over the tokens seen and the drafts before), temperature and top-k:
    # top-p shapes the target only. Any draft distribution q keeps the output exact (accept.py reads this q); this one
    # needs no cumulative sum over a sorted vocabulary and is what the C chain computes. The penalty is the target's
    # (a draft the target's penalty would demote is a draft it rejects: 3.28 -> 3.37 tokens a round greedy at k = 3 on
    # the shipped model, docs/decisions.md).
    rs = rs.for_drafts() if rs is not None and (rs.any_sampled or rs.use_penalty) else None
    if host is not None and mtp.style == "sequential" and K > 0:
        reduced = None if vocab is None else vocab.head(model, 1)  # (its layer: the chain's depths share one head)
        if vocab is None or reduced is not None:
            sampling = q = None
            if rs is not None:  # every row's pick as below: argmax(x + noise) (x shaped), a greedy row's argmax(x)
                q = torch.empty(B, K, model.config.vocab_size) if rs.any_unseeded else None
                penalty = (rs.penalty, st.seen) if rs.use_penalty and st.seen is not None else (None, None)
                sampling = PickRule(rs.temperature, rs.greedy, rs.top_k, noise, q, *penalty)
            done = model.mtp_draft(K, st.pend_h, st.pend_next, st.pend_n, st.mtp_pos, st.mtp_cache, width, host,
                                   None if vocab is None else (reduced, vocab.ids), sampling)
            if done is not None:  # the whole chain below in one call (CPU, where the family has one)
                return done, q
    rows = torch.arange(B, device=dev)
    at = model.decode_positions(st.mtp_pos[:, None] + torch.arange(width, device=dev), starts)
    hid, nxt = st.pend_h[:, :width], st.pend_next[:, :width]
    if mtp.style == "sequential":  # depth 1 reads the pending positions; its output at the last one drafts token 1
        h = model.mtp_step(1, hid, nxt, at, st.mtp_cache)[rows, st.pend_n - 1]  # [B, H]
        heads = None
    else:  # every head reads every kept position (whatever K), so their caches stay complete
        heads = [model.mtp_step(d, hid, None, at, st.mtp_cache)[rows, st.pend_n - 1] for d in range(1, mtp.num_layers + 1)]
    end = st.mtp_pos + st.pend_n  # [B]: the backbone's position (the last emitted token sits there)
    drafts, shaped = [], []
    seen = None if rs is None or not rs.use_penalty or st.seen is None else st.seen.clone()
    for j in range(1, K + 1):  # draft j proposes the token at position end + j
        if heads is not None:
            h = heads[j - 1]
        elif j > 1:  # the causal chain: draft j-1 feeds depth j, in the MTP slot after the previous step
            chain_at = model.decode_positions((end - 2 + j)[:, None],
                                              None if host is None else [s + n - 2 + j for s, n in zip(*host)])
            h = model.mtp_step(j, h[:, None], drafts[-1][:, None], chain_at, st.mtp_cache)[:, 0]
        if rs is None:  # greedy with no shaping: the argmax (over the reduced vocabulary's head rows if one is given)
            drafts.append(argmax(model.draft_head(h, j)) if vocab is None else vocab.argmax(model, h, j))
            continue
        logits = model.draft_head(h, j) if vocab is None else vocab.full_logits(model, h, j)  # [B, V]
        x = shape_logits(logits[:, None], rs, None if seen is None else seen[:, None])[:, 0]  # [B, V]
        picked = x if noise is None else torch.where(rs.greedy[:, None], x, x + noise[:, j - 1])
        drafts.append(argmax(picked))
        if seen is not None:
            seen.scatter_(1, drafts[-1][:, None], True)
        shaped.append(x)
    drafts_t = torch.stack(drafts, 1) if drafts else torch.zeros(B, 0, dtype=torch.long, device=dev)
    return drafts_t, (torch.stack(shaped, 1) if shaped and rs is not None and rs.any_unseeded else None)


def verify(model, st: RoundState, drafts: torch.Tensor, limit: torch.Tensor, active: torch.Tensor,
           rs: RowSampling | None, draft_logits: torch.Tensor | None, noise: torch.Tensor | None,
           u: torch.Tensor | None, starts: list[int] | None = None, appended=None) -> torch.Tensor:
    """Steps 2-4 for drafts [B, K]: verify in ONE backbone forward, accept, keep. `limit` [B]: drafts row b may use
    (<= K), `active` [B] bool: rows decoding this round. `rs`/`draft_logits`/`noise`/`u`: as in `accept.accept_rows`
    (rs None: every row greedy with no shaping). `starts`: the rows' positions on the host (eager attention) or None.
    `appended`: a drafter whose tokens ride along after each row's block (`masks.MaskDrafter`): `appended.ids(last,
    drafts, limit)` gives the forward's ids [B, K+1+E] (row b's first limit[b]+1 are last and its drafts, as here),
    and `appended.read(hidden)` takes the forward's hidden [B, K+1+E, H] before the accept.

    Returns tokens [B, K+2]: row b emitted tokens[b, :n+1] (its accepted drafts, then its next token) and
    tokens[b, K+1] = n (one tensor, so the host synchronises once)."""
    B, K = drafts.shape
    dev = drafts.device
    if K == 0 and appended is None and not torch.compiler.is_compiling():  # a plain step: the state's own columns
        ids, index = st.last[:, None], st.pos[:, None]  # (read by the forward, before the accept moves them on)
    else:
        ids = torch.cat([st.last[:, None], drafts], dim=1) if appended is None else appended.ids(st.last, drafts, limit)
        index = st.pos[:, None] + torch.arange(ids.shape[1], device=dev)
    at = model.decode_positions(index, starts)
    # an eager plain step that every row keeps: recurrent states may update in place (the CPU's C step; reading the
    # mask on the host costs nothing there; a compiled step keeps its static shape and selects as ever)
    at.commit = (ids.shape[1] == 1 and dev.type == "cpu" and not torch.compiler.is_compiling()
                 and bool(active.all()))
    hidden, steps = model.decode(ids, st.cache, at)  # ONE backbone forward for every row
    if appended is not None:
        appended.read(hidden)
        hidden = hidden[:, : K + 1]
    logits = model.head(hidden)  # [B, K+1, V]
    return accept_and_keep(st, steps, hidden, logits, drafts, limit, active, rs, draft_logits, noise, u)


def accept_and_keep(st: RoundState, steps: list, hidden: torch.Tensor, logits: torch.Tensor, drafts: torch.Tensor,
                    limit: torch.Tensor, active: torch.Tensor, rs: RowSampling | None, draft_logits: torch.Tensor | None,
                    noise: torch.Tensor | None, u: torch.Tensor | None) -> torch.Tensor:
    """Steps 3-4 after the verify forward (its `steps`, hidden [B, K+1, H] and logits [B, K+1, V]): `verify`'s
    arguments and result."""
    B, K = drafts.shape
    fast = round_kernel.usable(st, drafts, hidden)
    if rs is None and fast:  # greedy on the CPU: the same, as one C call
        tokens, keep = round_kernel.accept_greedy(st, argmax(logits), drafts, limit, active, hidden)
        st.cache.keep_at(steps, keep)
        return tokens
    dev = drafts.device
    rows = torch.arange(B, device=dev)
    slot = torch.arange(K + 1, device=dev)
    if rs is None:
        n, nxt = accept.accept_argmax(drafts, limit, logits)
    else:
        target = shape_logits(logits, rs, seen_before(st.seen, drafts))
        n, nxt = accept.accept_rows(drafts, limit, target, draft_logits, rs, noise, u)
        if fast:  # the rule decided n and next: the greedy accept over those tokens with n the limit emits and keeps
            # them (the same, as one C call)
            chosen = torch.where(slot < n[:, None], torch.cat([drafts, nxt[:, None]], 1), nxt[:, None])
            tokens, keep = round_kernel.accept_greedy(st, chosen, drafts, n, active, hidden)
            st.cache.keep_at(steps, keep)
            return tokens
    n = torch.where(active, n, 0)
    keep = torch.where(active, n + 1, 0)
    tokens = torch.where(slot == n[:, None], nxt[:, None], torch.cat([drafts, nxt[:, None]], 1))  # [d_1..d_n, next, ..]

    st.cache.keep_at(steps, keep)
    st.pos.add_(keep)
    st.last.copy_(torch.where(active, nxt, st.last))
    if st.mtp_cache is not None:
        if K > 0:  # the MTP read the old pending positions; the kept ones are the next round's
            st.mtp_pos.add_(torch.where(active, st.pend_n, 0))
            upd = active[:, None]
            st.pend_h[:, : K + 1].copy_(torch.where(upd[..., None], hidden.to(st.pend_h.dtype), st.pend_h[:, : K + 1]))
            st.pend_next[:, : K + 1].copy_(torch.where(upd, tokens, st.pend_next[:, : K + 1]))
            st.pend_n.copy_(torch.where(active, keep, st.pend_n))
        else:  # nothing was drafted, so the MTP has not read the pending positions: append this one
            at_n = st.pend_n.clamp(max=PENDING - 1)
            st.pend_h[rows, at_n] = torch.where(active[:, None], hidden[:, 0].to(st.pend_h.dtype), st.pend_h[rows, at_n])
            st.pend_next[rows, at_n] = torch.where(active, nxt, st.pend_next[rows, at_n])
            st.pend_n.add_(active.long())
    if st.seen is not None:
        emitted = (slot <= n[:, None]) & active[:, None]
        st.seen.logical_or_(torch.zeros_like(st.seen, dtype=torch.long).scatter_add_(1, tokens, emitted.long()) > 0)
    return torch.cat([tokens, n[:, None]], dim=1)


def catch_up(model, st: RoundState, rows_mask: torch.Tensor, starts: list[int] | None = None) -> None:
    """The MTP reads all but the last pending position of the rows in rows_mask [B] (after a run of rounds that drafted
    nothing a row's pending buffer is full; the decoder moves every row with positions pending along with it); the last
    stays pending, to draft from when drafting resumes. Every row runs through the forward: a row's positions past its
    pending ones are written past its MTP position, overwritten before they are read."""
    width = PENDING - 1
    dev = st.pos.device
    done = None
    if starts is not None and model.mtp.style == "sequential":  # eagerly, as one call where the family has one: the
        # draft chain with no drafts, its depth 1 reading the positions (the same caches as the step below)
        done = model.mtp_draft(0, st.pend_h, st.pend_next, st.pend_n.clamp(max=width), st.mtp_pos, st.mtp_cache, width,
                               (starts, [width] * len(starts)))
    if done is None:
        at = model.decode_positions(st.mtp_pos[:, None] + torch.arange(width, device=dev), starts)
        depths = range(1, 2) if model.mtp.style == "sequential" else range(1, model.mtp.num_layers + 1)
        for d in depths:
            model.mtp_step(d, st.pend_h[:, :width], st.pend_next[:, :width] if model.mtp.style == "sequential" else None,
                           at, st.mtp_cache)
    # (rows outside the mask wrote past their MTP position only: overwritten before read)
    moved = torch.where(rows_mask, st.pend_n - 1, 0)
    st.mtp_pos.add_(moved)
    rows = torch.arange(st.pos.shape[0], device=dev)
    last_h, last_next = st.pend_h[rows, st.pend_n - 1], st.pend_next[rows, st.pend_n - 1]
    st.pend_h[:, 0] = torch.where(rows_mask[:, None], last_h, st.pend_h[:, 0])
    st.pend_next[:, 0] = torch.where(rows_mask, last_next, st.pend_next[:, 0])
    st.pend_n.copy_(torch.where(rows_mask, 1, st.pend_n))
