"""Continuous batching with batched speculative decoding: many sequences, one backbone forward per round.

Sequences join and leave between rounds. Each holds one row of a batched cache (its own position, attention
entries, DeltaNet state and MTP cache entries); rows [0, D) are decoding, and at most one newcomer at row D reads its
prompt, one chunk per `step` (the same chunks as a solo prefill), between the decoding rounds.

One round for the D decoding rows (the same four steps as `speculative.py`, batched):
  1. draft    - one MTP forward catches every row up on the positions it kept last round (rows padded to the
                longest), then k-1 chained steps for all rows at once; row b keeps min(k, what it has left) drafts.
  2. verify   - ONE backbone forward over [D, k+1]: row b = [its last token, its drafts, padding].
  3. accept   - per row, greedy or sampled (`speculative.accept`); rows are independent.
  4. rollback - `cache.keep_rows(verified, n_b + 1)`: each row selects its own kept state; padding is dropped.
Every position of every row is computed exactly as when that sequence decodes alone (attention runs row by row
over the row's own keys, the linear layers are row-invariant in bf16/int8, DeltaNet is recurrent per row), so a
greedy sequence's output equals its solo output. k comes from `policy.BatchDraftPolicy` (0: MTP off).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .draft_vocab import DraftVocab
from .policy import BatchDraftPolicy
from .prefill import PREFILL_CHUNK, prefill_chunk
from .session import Session
from .speculative import MAX_DRAFT, accept


@dataclass
class Sequence:
    """One sequence in the batch: its session and where it stands."""

    session: Session
    prompt: list[int]
    read: int = 0  # prompt tokens read so far
    hidden: list[torch.Tensor] = field(default_factory=list)  # prefill hidden chunks, until the first token
    mtp_pos: int = 0  # MTP slots 0..mtp_pos-1 hold accepted (h_j, t_{j+1})
    pending: list[torch.Tensor] = field(default_factory=list)  # [m_i, H] chunks: kept positions the MTP has not read
    pending_next: list[int] = field(default_factory=list)
    cancelled: bool = False

    @property
    def decoding(self) -> bool:
        return self.read == len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.session.done or self.cancelled


class BatchDecoder:
    """Decode up to `max_batch` sequences together. `add` a Session, call `step` until it reports the sequence done."""

    def __init__(self, model, max_batch: int, max_len: int, draft_tokens: int | str | None,
                 draft_vocab: DraftVocab | None = None):
        self.model = model
        use_mtp = draft_tokens not in (None, 0) and model.mtp is not None
        limit = MAX_DRAFT if not use_mtp or model.mtp.max_depth is None else min(MAX_DRAFT, model.mtp.max_depth)
        self.policy = BatchDraftPolicy.from_arg(draft_tokens if use_mtp else None, limit)
        self.max_len = min(max_len + self.policy.k_max + 2, model.context_length)
        self.cache = model.new_cache(max_batch, self.max_len, rows=True)
        self.mtp_cache = model.new_mtp_cache(max_batch, self.max_len) if use_mtp else None
        self.vocab = draft_vocab
        self.max_batch = max_batch
        self.rows: list[Sequence] = []  # row i <-> rows[i]; decoding ones first
        self.waiting: list[Sequence] = []
        self.last_round: list[tuple[Sequence, int, int]] = []  # (sequence, drafts made k, accepted n) of the last round

    # ------------------------------------------------------------------ membership
    @property
    def decoding(self) -> int:
        return sum(s.decoding for s in self.rows)

    def add(self, session: Session) -> Sequence:
        """Queue a sequence; it takes a row when one is free and reads its prompt between rounds."""
        if len(session.tokens) + session.max_new > self.max_len:
            raise ValueError(f"prompt + max_new_tokens ({len(session.tokens) + session.max_new}) exceed this batch's "
                             f"cache of {self.max_len} positions")
        seq = Sequence(session, list(session.tokens))
        self.waiting.append(seq)
        return seq

    def _drop_finished(self) -> None:
        """Free the rows of finished or cancelled sequences, keeping rows contiguous with the decoding ones first: the
        last decoding row fills the gap, and the newcomer reading its prompt (always last) moves down behind it."""
        i = 0
        while i < len(self.rows):
            if not self.rows[i].finished:
                i += 1
                continue
            if self.rows[i].decoding:
                last_decoding = self.decoding - 1
                if i != last_decoding:
                    self._move(last_decoding, i)
                if last_decoding + 1 < len(self.rows):  # the reader
                    self._move(last_decoding + 1, last_decoding)
            self.rows.pop()

    def _move(self, src: int, dst: int) -> None:
        self.cache.copy_row(src, dst)
        if self.mtp_cache is not None:
            for c in self.mtp_cache:
                c.copy_row(src, dst, self.max_len)
        self.rows[dst] = self.rows[src]

    # ------------------------------------------------------------------ one scheduler step
    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """Read one prompt chunk of the newcomer (if any) and run one round for the decoding rows.
        Returns (sequence, tokens emitted) for every sequence that emitted tokens."""
        self._drop_finished()
        self.last_round = []
        out: list[tuple[Sequence, list[int]]] = []
        reading = next((s for s in self.rows if not s.decoding), None)
        while reading is None and self.waiting and len(self.rows) < self.max_batch:
            reading = self.waiting.pop(0)
            if reading.cancelled:
                reading = None
                continue
            self.rows.append(reading)
            self.cache.reset_row(len(self.rows) - 1)
        if reading is not None:
            emitted = self._read_chunk(reading, len(self.rows) - 1)
            if emitted:
                out.append((reading, emitted))
        d = self.decoding
        if d:
            out += self._round(d)
        return out

    def _read_chunk(self, seq: Sequence, row: int) -> list[int]:
        """One prefill chunk of `seq` at `row`; after the last one, its first token (and its MTP catch-up)."""
        model, stats = self.model, seq.session.stats
        t0 = time.perf_counter()
        view = self.cache.view(row, row + 1)
        seq.hidden.append(prefill_chunk(model, seq.prompt, view, seq.read))
        self.cache.sync(view, row)
        seq.read = min(seq.read + PREFILL_CHUNK, len(seq.prompt))
        if not seq.decoding:
            stats.time_prefill += time.perf_counter() - t0
            return []
        hidden = torch.cat(seq.hidden, dim=1)[0]  # [P, H]
        seq.hidden = []
        first = seq.session.choose(model.head(hidden[-1]))
        stats.prefill_forwards += 1
        nxt = seq.prompt[1:] + [first]
        if self.mtp_cache is not None and len(seq.prompt) > 1:  # the MTP reads the prompt now, all but its last position
            views = [c.rows(row, row + 1) for c in self.mtp_cache]
            for d in self._catch_up_depths():
                model.mtp_step(d, hidden[None, :-1], torch.tensor([nxt[:-1]], device=model.device), 0, views)
            seq.mtp_pos = len(seq.prompt) - 1
        seq.pending, seq.pending_next = [hidden[-1:]], nxt[-1:]
        stats.time_prefill += time.perf_counter() - t0
        return seq.session.emit([first], ["prefill"])

    def _catch_up_depths(self) -> range:
        """The MTP depths that read kept positions: depth 1 (sequential) or every head (parallel)."""
        mtp = self.model.mtp
        return range(1, 2) if mtp.style == "sequential" else range(1, mtp.num_layers + 1)

    # ------------------------------------------------------------------ the batched round
    def _round(self, D: int) -> list[tuple[Sequence, list[int]]]:
        model = self.model
        seqs = self.rows[:D]
        t0 = time.perf_counter()
        k = self.policy.next_k(D)
        ks = [max(0, min(k, s.session.max_new - len(s.session.new_tokens) - 1)) for s in seqs]
        K = max(ks)
        if self.mtp_cache is not None and K > 0:
            drafts, q_rows = self._draft(seqs, ks, K)
        else:  # no drafts this round: the MTP reads the kept positions when drafting resumes, not now
            drafts, q_rows = [[] for _ in seqs], [[] for _ in seqs]
        t_draft = time.perf_counter() - t0

        # 2. verify: one forward over [D, K + 1]
        t = time.perf_counter()
        x = torch.zeros(D, K + 1, dtype=torch.long)
        for b, s in enumerate(seqs):
            x[b, : ks[b] + 1] = torch.tensor([s.session.tokens[-1]] + drafts[b])
        view = self.cache.view(0, D)  # a single row is a plain single-sequence cache (the same arithmetic)
        verified = model.verify(x.to(model.device), view)
        logits = model.head(verified.hidden)  # [D, K+1, V]
        t_verify = time.perf_counter() - t

        # 3. accept, 4. roll back, commit, emit
        t = time.perf_counter()
        result = [accept(s.session, drafts[b], q_rows[b], logits[b]) for b, s in enumerate(seqs)]
        keep = [n + 1 for n, _ in result]
        if view.rows is None:
            view.keep(verified, keep[0])
        else:
            view.keep_rows(verified, keep)
        self.cache.sync(view, 0)
        out = []
        for b, (s, (n, nxt)) in enumerate(zip(seqs, result)):
            if self.mtp_cache is not None:
                if K == 0:  # nothing was drafted, so the MTP has not read the pending positions: keep them
                    s.pending.append(verified.hidden[b, :1])
                    s.pending_next.append(nxt)
                else:
                    s.pending = [verified.hidden[b, : n + 1]]
                    s.pending_next = drafts[b][:n] + [nxt]
            st = s.session.stats
            st.backbone_forwards += 1
            st.record_step(ks[b], n)
            st.time_draft += t_draft
            st.time_verify += t_verify
            kinds = ["draft"] * n + ["plain" if ks[b] == 0 else "bonus" if n == ks[b] else "correction"]
            emitted = s.session.emit(drafts[b][:n] + [nxt], kinds)
            if emitted:
                out.append((s, emitted))
        other = time.perf_counter() - t
        for s in seqs:
            s.session.stats.time_other += other
        self.policy.update(D, k, [(ks[b], result[b][0]) for b in range(D)], time.perf_counter() - t0)
        self.last_round = [(s, ks[b], result[b][0]) for b, s in enumerate(seqs)]
        return out

    def _draft(self, seqs: list[Sequence], ks: list[int], K: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Catch every row up on its kept positions, then draft K tokens for all rows (row b keeps ks[b])."""
        model, mtp = self.model, self.model.mtp
        D = len(seqs)
        pending = [s.pending[0] if len(s.pending) == 1 else torch.cat(s.pending) for s in seqs]
        M = max(p.shape[0] for p in pending)
        hidden = pending[0].new_zeros(D, M, pending[0].shape[-1])
        nxt = torch.zeros(D, M, dtype=torch.long, device=model.device)
        for b, s in enumerate(seqs):
            m = pending[b].shape[0]
            hidden[b, :m] = pending[b]
            nxt[b, :m] = torch.tensor(s.pending_next)
        starts = [s.mtp_pos for s in seqs]
        views = [c.rows(0, D) for c in self.mtp_cache]
        lasts = torch.tensor([p.shape[0] - 1 for p in pending], device=model.device)
        rows = torch.arange(D, device=model.device)
        if mtp.style == "sequential":
            out = model.mtp_step(1, hidden, nxt, starts, views)
            last = out[rows, lasts][:, None]  # [D, 1, H]: each row's last kept position drafts its token 1
            heads = None
        else:
            heads = [model.mtp_step(d, hidden, None, starts, views)[rows, lasts][:, None]
                     for d in range(1, mtp.num_layers + 1)]
        ends = [s.mtp_pos + p.shape[0] for s, p in zip(seqs, pending)]
        for s, end in zip(seqs, ends):
            s.mtp_pos = end
        drafts: list[list[int]] = [[] for _ in seqs]
        q_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(1, K + 1):
            if heads is not None:
                h = heads[j - 1]
            elif j > 1:  # the causal chain, every row at the slot after its previous step
                tok = torch.tensor([[d[-1] if d else 0] for d in drafts], device=model.device)
                last = model.mtp_step(j, last, tok, [e - 2 + j for e in ends], views)
                h = last
            else:
                h = last
            logits = (model.mtp_head(h[:, -1], j) if self.vocab is None else None)
            for b, s in enumerate(seqs):
                if j > ks[b]:
                    continue
                if self.vocab is None:
                    token, q = s.session.propose(logits[b], drafts[b])
                else:
                    reduced = self.vocab.logits(model, h[b, -1], j)
                    token, q = ((int(self.vocab.ids[reduced.argmax()]), None) if s.session.plain_argmax
                                else s.session.propose(self.vocab.full_logits(reduced), drafts[b]))
                drafts[b].append(token)
                if q is not None:
                    q_rows[b].append(q)
        return drafts, q_rows
