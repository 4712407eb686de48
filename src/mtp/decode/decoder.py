"""The decoder: one or many sequences decoded together by speculative rounds (`round.py`), on the host side.

`generate`/`stream` decode one sequence as a batch of one; `mtp serve` decodes many (continuous batching). Each
sequence holds one row of the batched state (its own positions, attention entries, Gated DeltaNet state, MTP cache
entries); rows [0, D) are decoding, and at most one newcomer at row D reads its prompt, one chunk per `step` (the
same chunks as alone, so its numbers do not depend on its company), between the rounds.

One `step`:
  - admit:   a waiting sequence takes a free row; one chunk of its prompt is read, and the MTP reads it (the first
             chunk may come from the prompt cache, `prompt_cache.py`; after the last chunk: its first token);
  - k:       the policy picks the round's draft length (`policy.DraftPolicy`, 0 = no drafts);
  - round:   `round.draft` then `round.verify` for the decoding rows (compiled: padded to a batch bucket; the padding rows
             keep nothing), eager or compiled (`compiled.py`); the host reads one tensor back;
  - emit:    each sequence's session takes its tokens (EOS, stop strings, length).
Every position of every row is computed exactly as when that sequence decodes alone and as a plain decoding step
computes it (docs/architecture.md, "One speculative round"), so a greedy sequence's output is the same alone, in a
batch, with any k and without MTP.
"""

from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..model.argmax_kernel import argmax
from ..model.linear import FastLinear, prompt_products, row_invariant
from . import policy_store, round_kernel
from .compiled import Runner
from .draft_vocab import DraftVocab
from .masks import MaskDrafter
from .policy import AFTER_FULL, Acceptance, DraftPolicy, RoundTimes
from .prefill import PREFILL_CHUNK, prefill_chunk
from .prompt_cache import PromptCache, Snapshot
from .round import MAX_DRAFT, PENDING, RoundState
from .sampling import RowSampling, gumbel, shape_logits
from .session import Session

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # batch sizes the round runs at (a compiled graph each)
# Rounds just after a prompt chunk run slower, whatever their k, and recover over a few rounds (measured, 8 rows of the
# shipped model, AMX Xeon: plain 4.3-4.6, 4.0-4.4, 3.6-3.9, 3.3-3.5 ms in the 1st-4th round after a chunk, 3.0-3.1 from
# the 7th; k = 3: 10.8-10.9 down to 9.7-9.9). A 20 ms sleep or Python spin between rounds does the same, and a compute
# loop's speed is unchanged after AMX products: data untouched for ~10 ms leaves the shared L3 (its neighbours' traffic)
# and takes ~3 passes to come back (docs/decisions.md, eighteenth session). In a server, the first round at a new batch
# size always follows the newcomer's last chunk: its time had made k = 0 look 1.4-2x its cost, so `auto` drafted 4-6
# tokens where k = 0 and 3 tie.
COLD_ROUNDS = 4
SLOT_ALIGN = 64  # cache lengths are a multiple of this (compiled attention reduces over whole vector blocks)
# An eager decoder whose state holds up to this many positions takes it from the model's pool and leaves it there (as a
# compiled one always does): a generation binds its C round programs to its state, ~0.3-0.6 ms a round shape, and
# `auto` visits 3-4 shapes a generation, so over 128 tokens binding anew took 4-6% of its rounds' time (code-small;
# docs/decisions.md, 2026-12-06, fourth session). Longer states are freed with their decoder: the pool keeps each
# shape it has seen until the model goes.
POOL_SLOTS = 4096


def _has_bf16_kernels(model) -> bool:
    """Does any prepared linear layer of the backbone run the bf16 kernel?"""
    return any(isinstance(m, FastLinear) and m.kernel == "bf16" for m in model.model.modules())


def cache_slots(max_len: int, pooled: bool, context: int) -> int:
    """Cache length for sequences of up to max_len (<= context) positions. The verify and chain steps write up to
    PENDING + MAX_DRAFT slots past a sequence's last position; lengths are multiples of SLOT_ALIGN. A compiled graph
    has its cache length baked in, and a pooled state serves later generations, so `pooled` decoders (compiled ones,
    and eager ones up to POOL_SLOTS) round up to a power of two (at least 256; at most the whole context's length):
    generations of other lengths reuse the same few graphs and states instead of compiling or binding new ones
    (compiled attention then reads at most twice the slots it needs; eager attention reads the positions there are)."""
    aligned = lambda n: -(-(n + PENDING + MAX_DRAFT + 2) // SLOT_ALIGN) * SLOT_ALIGN  # noqa: E731
    if pooled:
        return min(max(256, 1 << (aligned(max_len) - 1).bit_length()), aligned(context))
    return aligned(max_len)


def bucket(n: int) -> int:
    return next((b for b in BUCKETS if b >= n), n)


@dataclass
class Sequence:
    """One sequence in the decoder: its session and where it stands."""

    session: Session
    prompt: list[int]
    read: int = 0  # prompt tokens read so far
    carry: torch.Tensor | None = None  # [H]: the backbone's hidden state at position read - 1
    cached: int = 0  # prompt tokens taken from the prompt cache
    cancelled: bool = False

    @property
    def decoding(self) -> bool:
        return self.read == len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.session.done or self.cancelled


class Decoder:
    """Decode up to `max_batch` sequences together. `add` a Session, call `step` until it reports the sequence done.

    `max_len`: the positions a sequence may reach (prompt + new tokens), capped at the model's context; the state is
    sized to it (never to the model's maximum context). `draft_tokens`: None/0 plain decoding, 1..8 or "auto".
    `compile`: run the round through compiled graphs (`compiled.Runner`). `prompt_cache`: where prompts' states are
    kept and found again (`prompt_cache.py`; a server's, shared by its decoders). `chain`: the rounds one `step` may
    run back to back in one C call for a lone greedy sequence (`round_kernel.greedy_rounds`: at a fixed k, or `auto`'s
    k by state up to its next probe; 1: a step is one round, as a server's must be to admit and cancel between rounds)."""

    def __init__(self, model, max_batch: int, max_len: int, draft_tokens: int | str | None,
                 draft_vocab: DraftVocab | None = None, compile: bool = False, prompt_cache: PromptCache | None = None,
                 chain: int = 1):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        if not model.prepared:  # row-invariant kernels: what exact speculative decoding and batching rest on
            with torch.inference_mode(False), torch.no_grad():  # normal tensors: training may use the model later
                model.prepare_for_inference()
        use_mtp = draft_tokens not in (None, 0) and model.mtp is not None
        limit = MAX_DRAFT if not use_mtp or model.mtp.max_depth is None else min(MAX_DRAFT, model.mtp.max_depth)
        # a model without MTP but with mask tokens (`model/masks.py`) drafts from the mask block of each forward
        use_masks = draft_tokens not in (None, 0) and not use_mtp and model.__dict__.get("masks") is not None
        if use_masks:
            if compile:
                raise ValueError("drafting from mask tokens runs eagerly: compile=True is not supported with a masks adapter")
            limit = min(MAX_DRAFT, model.masks.config.masks)
        # round times measured by earlier decoders of this model in the same setup, and the acceptance they saw with
        # the same drafter (`DraftPolicy.from_arg`); the first `auto` decoder of a setup in this process starts from
        # what an earlier process measured, where it was kept (`policy_store`)
        setup = (compile, torch.get_num_threads(), draft_vocab is not None, use_masks, max_batch)
        rounds = model.__dict__.setdefault("_round_times", {}).setdefault(setup, RoundTimes())
        counts = model.__dict__.setdefault("_acceptance", {}).setdefault((draft_vocab is not None, use_masks),
                                                                          Acceptance())
        tried = model.__dict__.setdefault("_stored_setups", set())
        if (draft_tokens == "auto" and (use_mtp or use_masks) and setup not in tried and not rounds.samples
                and policy_store.enabled()):
            tried.add(setup)
            key = policy_store.key(model, setup, None if draft_vocab is None else draft_vocab.size)
            if key is not None:
                policy_store.load(key, rounds, counts, fill_counts=not any(c.offered for c in counts.by_state))
        if draft_tokens == "auto" and use_mtp and max_batch == 1 and rounds.rest():
            use_mtp = False  # drafting has not paid here: this generation runs plain (`RoundTimes.rest`)
        self.policy = DraftPolicy.from_arg(draft_tokens if use_mtp or use_masks else None, limit, rounds, counts)
        self.max_len = min(max_len, model.context_length)
        pooled = compile or cache_slots(self.max_len, True, model.context_length) <= POOL_SLOTS
        slots = cache_slots(self.max_len, pooled, model.context_length)
        model.prepare_decode(slots)
        self.max_batch = max_batch
        self.chain = chain  # rounds a step may run back to back for a lone greedy sequence (`_chain`)
        self.state = self._take_state(bucket(max_batch), slots, use_mtp, pooled)
        self.masks = MaskDrafter(model, self.state.pos.shape[0]) if use_masks else None
        self.vocab = draft_vocab
        self.vocab_head = None  # the reduced vocabulary's head layer, where the one-call round reads one
        if draft_vocab is not None and use_mtp:
            draft_vocab.prepare(model, self.policy.k_max if model.mtp.max_depth is None else model.mtp.num_layers)
            # (looked up once: its checks of the model's device, dtype and head weights took ~12 us a round, and the
            # model does not change under a decoder)
            self.vocab_head = draft_vocab.head(model, 1)
        self.runner = Runner.for_model(model, compile)
        if compile and use_mtp and _has_bf16_kernels(model):  # (the default warning filter shows it once)
            warnings.warn("compiled speculative decoding with bf16 linear layers is not bit-exact yet: on 1 of 7 bench "
                          "prompts it departs from compiled plain decoding after 51 tokens (docs/decisions.md, issue 18); "
                          "eager decoding, and compiled int8, are exact", stacklevel=3)
        self.rows: list[Sequence] = []  # row i <-> rows[i]; decoding ones first
        self.waiting: list[Sequence] = []
        self.last_round: list[tuple[Sequence, int, int]] = []  # (sequence, drafts made k, accepted n) of the last round
        self.mtp_pos: list[int] = [0] * self.state.pos.shape[0]  # host mirrors of the MTP positions / pending counts
        self.pend_n: list[int] = [0] * self.state.pos.shape[0]
        self._since_chunk = COLD_ROUNDS  # rounds since the last prompt chunk
        self._sampling: tuple[tuple, RowSampling | None] | None = None
        self.prompts = prompt_cache
        if prompt_cache is not None:
            prompt_cache.bind(model)

    def _take_state(self, rows: int, slots: int, use_mtp: bool, pooled: bool) -> RoundState:
        """The decode state: new, or where `pooled` a free one of the model's with the same shape (returned to the
        model when this decoder is collected). A captured CUDA graph reads and writes its state at the addresses it
        was recorded with: a new state for every generation made cudagraph trees record every graph again on its
        first round (and give up on graphs after a limit of such re-recordings); the eager round's C programs are bound
        to its addresses too (POOL_SLOTS). A row's state is reset as a sequence takes it (`_reset_row`), as the
        server's rows are between requests."""
        if not pooled:
            return RoundState.allocate(self.model, rows, slots, use_mtp, penalty=False)
        # (the model's dtype, device and MTP module shape its caches: a model cast or given a new MTP gets new states; a
        # weak reference, not an id, which a later module may reuse)
        mtp = None if self.model.mtp is None else weakref.ref(self.model.mtp)
        key = (rows, slots, use_mtp, self.model.dtype, str(self.model.device), mtp)
        free = self.model.__dict__.setdefault("_free_states", {}).setdefault(key, [])
        if free:
            state = free.pop()
            state.restart()
        else:
            state = RoundState.allocate(self.model, rows, slots, use_mtp, penalty=False)
        weakref.finalize(self, free.append, state)
        return state

    @property
    def use_mtp(self) -> bool:
        return self.state.mtp_cache is not None

    @property
    def decoding(self) -> int:
        return sum(s.decoding for s in self.rows)

    # ------------------------------------------------------------------ membership
    def add(self, session: Session) -> Sequence:
        """Queue a sequence; it takes a row when one is free and reads its prompt between rounds."""
        if len(session.tokens) + session.max_new > self.max_len:
            raise ValueError(f"prompt + max_new_tokens ({len(session.tokens) + session.max_new}) exceed this decoder's "
                             f"{self.max_len} positions")
        if session.params.repetition_penalty != 1.0 and self.state.seen is None:
            self.state.seen = torch.zeros(self.state.pos.shape[0], self.model.config.vocab_size, dtype=torch.bool,
                                          device=self.model.device)
            self.state.__dict__.pop("views", None)  # (made without it)
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
        for t in self.state.tensors():
            t[dst] = t[src]
        self.state.cache.rows[dst] = self.state.cache.rows[src]
        self.mtp_pos[dst], self.pend_n[dst] = self.mtp_pos[src], self.pend_n[src]
        if self.masks is not None:
            self.masks.move(src, dst)
        self.policy.move_row(src, dst)
        self.rows[dst] = self.rows[src]

    def _reset_row(self, row: int) -> None:
        st = self.state
        st.cache.reset_row(row)
        st.pos[row] = 0
        if self.use_mtp:
            st.mtp_pos[row] = 0
            st.pend_n[row] = 0
        if st.seen is not None:
            st.seen[row] = False
        if self.masks is not None:
            self.masks.reset_row(row)
        self.policy.reset_row(row)
        self.mtp_pos[row] = self.pend_n[row] = 0

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
            self._reset_row(len(self.rows) - 1)
        if reading is not None:
            self._since_chunk = 0
            emitted = self._read_chunk(reading, len(self.rows) - 1)
            if emitted:
                out.append((reading, emitted))
            if reading.finished:  # done at its first token (EOS, a stop string, max_new 1): no round for its row
                self._drop_finished()
        d = self.decoding
        if d:
            out += self._round(d, self._since_chunk < COLD_ROUNDS)
            self._since_chunk += 1
        return out

    def _read_chunk(self, seq: Sequence, row: int) -> list[int]:
        """One prefill chunk of `seq` at `row` (its first: from the prompt cache where it holds a prefix); after the
        last one, its first token."""
        model, st, stats = self.model, self.state, seq.session.stats
        t0 = time.perf_counter()
        P = len(seq.prompt)
        if seq.read == 0 and self.prompts is not None and (snap := self.prompts.lookup(seq.prompt, self.use_mtp)):
            self._restore(seq, row, snap)
        if seq.read < P:  # (nothing left after a whole prompt from the cache)
            view = st.cache.view(row, row + 1)
            lo = seq.read
            hidden = prefill_chunk(model, seq.prompt, view, lo)[0]  # [n, H]
            st.cache.sync(view, row)
            # while it reads, the row may sit in a compiled round's bucket as a row that keeps nothing: its verify still writes
            # keys/values at pos + 0..K, which must land past what it has read (the next chunk overwrites them), not on
            # its prompt's first positions
            st.pos[row] = view.pos
            seq.read = min(lo + PREFILL_CHUNK, P)
            if self.use_mtp:
                self._mtp_read(seq, row, lo, hidden)
            seq.carry = hidden[-1]
            if self.prompts is not None and self.prompts.wants(seq.prompt, seq.read):
                self.prompts.store(self._snapshot(seq, row))
        if not seq.decoding:
            stats.time_prefill += time.perf_counter() - t0
            return []
        h = seq.carry
        logits = model.head(h)
        model.check_finite(logits, "the prompt's forward")  # NaN/Inf weights would otherwise show as a lone EOS
        first = self._first_token(seq.session, logits)
        stats.prefill_forwards += 1
        stats.prompt_cached = seq.cached
        st.pos[row], st.last[row] = P, first
        if st.seen is not None:
            st.seen[row, torch.tensor(seq.prompt + [first], device=model.device)] = True
        if self.use_mtp:  # the prompt's last position waits for the MTP's first round, with the first token
            st.mtp_pos[row], st.pend_n[row] = P - 1, 1
            st.pend_h[row, 0], st.pend_next[row, 0] = h, first
            self.mtp_pos[row], self.pend_n[row] = P - 1, 1
        seq.carry = None
        stats.time_prefill += time.perf_counter() - t0
        return seq.session.emit([first], ["prefill"])

    def _mtp_read(self, seq: Sequence, row: int, lo: int, hidden: torch.Tensor) -> None:
        """The MTP reads what the chunk of positions lo.. (hidden [n, H]) lets it: each position with the token after
        it, so from lo - 1 (the previous chunk's last, `carry`) to the chunk's last but one; its caches only
        (`mtp_fill`)."""
        model = self.model
        h = hidden if seq.carry is None else torch.cat([seq.carry[None], hidden])
        if h.shape[0] < 2:
            return
        start = lo - 1 if seq.carry is not None else lo
        views = [c.rows(row, row + 1) for c in self.state.mtp_cache]
        sequential = model.mtp.style == "sequential"
        ids = torch.tensor([seq.prompt[start + 1:lo + hidden.shape[0]]], device=model.device) if sequential else None
        with prompt_products():  # (int4/int8 drafts: the prompt's rows on the bf16 tiles)
            for d in range(1, 2) if sequential else range(1, model.mtp.num_layers + 1):
                model.mtp_fill(d, h[None, :-1], ids, start, views)

    def _snapshot(self, seq: Sequence, row: int) -> Snapshot:
        """Row `row` after the first seq.read tokens of its prompt, for the prompt cache."""
        n, st = seq.read, self.state
        mtp = [c.snapshot(row, n - 1) for c in st.mtp_cache] if self.use_mtp else None
        return Snapshot(seq.prompt[:n], st.cache.snapshot(row, n), mtp, seq.carry.clone())

    def _restore(self, seq: Sequence, row: int, snap: Snapshot) -> None:
        """Row `row` := a prompt-cache snapshot of the first snap.n tokens of its prompt; the read continues there."""
        st = self.state
        st.cache.restore(row, snap.backbone, snap.n)
        st.pos[row] = snap.n
        if self.use_mtp:
            for c, s in zip(st.mtp_cache, snap.mtp):
                c.restore(row, s)
        seq.read = seq.cached = snap.n
        seq.carry = snap.carry

    def _first_token(self, session: Session, logits: torch.Tensor) -> int:
        """The token after the prompt from the prefill's last logits [V] (the round's shaping and sampling rule)."""
        params = session.params
        if session.plain_argmax:
            return int(argmax(logits))
        rs = RowSampling.build([params], logits.shape[-1], logits.device)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(1, 1, logits.shape[-1], dtype=torch.bool, device=logits.device)
            seen[0, 0, torch.tensor(session.tokens, device=logits.device)] = True
        x = shape_logits(logits[None, None], rs, seen)[0, 0]
        if params.greedy:
            return int(argmax(x))
        at = len(session.tokens)
        noise = session.gumbel(at, x.shape[-1]) if session.seeded else gumbel(torch.rand(x.shape[-1], device=x.device))
        return int(argmax(x + noise))

    # ------------------------------------------------------------------ the round
    def _view(self, B: int) -> RoundState:
        """The state of rows [0, B) (views: the round's writes go to the decoder's state). Kept on the state, which a
        pooled state carries to the next decoder: the one-call round's programs are bound to the view they ran on
        (`round_kernel.greedy_round`), and a view new with each generation bound them again in its first round of
        each width (~0.3-0.6 ms), which `auto`'s probes paid in every generation (docs/decisions.md)."""
        views, key = self.state.__dict__.setdefault("views", {}), (B, self.runner.compiled)
        view = views.get(key)
        if view is None:
            st = self.state
            sl = lambda t: None if t is None else t[:B]  # noqa: E731
            cache = st.cache.view(0, B)
            cache.rows = st.cache.rows  # host positions stay the decoder's
            view = RoundState(cache, st.pos[:B], st.last[:B], None if st.mtp_cache is None else
                              [c.rows(0, B) for c in st.mtp_cache], sl(st.mtp_pos), sl(st.pend_h), sl(st.pend_next),
                              sl(st.pend_n), sl(st.seen))
            self.runner.static_state(view)
            views[key] = view
        return view

    def _row_sampling(self, seqs: list[Sequence], B: int) -> RowSampling | None:
        """The rows' sampling parameters (None: every row greedy with no shaping), rebuilt when the rows change."""
        key = tuple(id(s) for s in seqs) + (B,)
        if self._sampling is not None and self._sampling[0] == key:
            return self._sampling[1]
        rs = None
        if not all(s.session.plain_argmax for s in seqs):
            params = [s.session.params for s in seqs] + [seqs[0].session.params.__class__()] * (B - len(seqs))
            rs = RowSampling.build(params, self.model.config.vocab_size, self.model.device)
        self._sampling = (key, rs)
        return rs

    def _noise(self, seqs: list[Sequence], rs: RowSampling, B: int, K: int) -> tuple:
        """Per-round noise of the sampled rows: (draft noise [B, K, V], target noise [B, K+1, V], uniforms [B, K]).
        A seeded row's is its seed's noise at each position (a draft and the target share it); an unseeded row's is
        fresh for each draft and one more for its next token, which the acceptance rule reads at one position only
        (accept.py: the residual or bonus sample), so every position gets the same; a greedy row's is never read."""
        if not rs.any_sampled:
            return None, None, None
        V, dev = self.model.config.vocab_size, self.model.device
        target = torch.zeros(B, K + 1, V, device=dev)
        drafts = torch.zeros(B, K, V, device=dev)
        for b, s in enumerate(seqs):
            if s.session.seeded:
                at = len(s.session.tokens)
                g = torch.stack([s.session.gumbel(at + j, V) for j in range(K + 1)])
                target[b], drafts[b] = g, g[:K]
        u = None
        if rs.any_unseeded:  # one draw for every unseeded row
            rows = rs.unseeded.nonzero()[:, 0]
            g = gumbel(torch.rand(rows.numel(), K + 1, V, device=dev))
            drafts[rows], target[rows] = g[:, :K], g[:, K:]
            u = torch.rand(B, K, device=dev)
        return drafts, target, u

    def _round_steps(self, st: RoundState, K: int, ks: list[int], D: int, B: int, rs: RowSampling | None,
                     noise: tuple, t0: float) -> tuple[list[list[int]], float, float]:
        """The round's draft and verify step by step (`runner`: eager or compiled; `noise`: `_noise`'s) -> (tokens
        [B][K+2], seconds drafting, seconds verifying)."""
        model, dev = self.model, self.model.device
        eager = not self.runner.compiled
        limit = torch.tensor(ks, device=dev)
        active = torch.tensor([True] * D + [False] * (B - D), device=dev)
        d_noise, t_noise, u = noise
        if K > 0 and self.masks is not None:
            drafts, draft_logits = self.masks.draft(model, st, K, rs, d_noise)
        elif K > 0:
            width = max(self.pend_n[:B]) if eager else PENDING
            host = (self.mtp_pos[:B], self.pend_n[:B]) if eager else None
            drafts, draft_logits = self.runner.draft(model, st, K, rs, d_noise, self.vocab, width, host)
        else:
            drafts, draft_logits = torch.zeros(B, 0, dtype=torch.long, device=dev), None
        t_draft = time.perf_counter() - t0

        t = time.perf_counter()
        with row_invariant():
            out = self.runner.verify(model, st, drafts, limit, active, rs, draft_logits, t_noise, u,
                                     self.state.cache.rows[:B] if eager else None,
                                     appended=self.masks).tolist()  # the round's one sync
        return out, t_draft, time.perf_counter() - t

    def _kept(self, seqs: list[Sequence], ks: list[int], K: int, out: list[list[int]], t_draft: float,
              t_verify: float) -> list[tuple[Sequence, list[int]]]:
        """A round's tokens (`out` [B][K+2]: the tokens, then n) into the host's positions and the sequences' sessions
        and stats -> (sequence, tokens emitted) of those that emitted any."""
        t = time.perf_counter()
        emitted = []
        for b, s in enumerate(seqs):
            n = out[b][K + 1]
            self.state.cache.rows[b] += n + 1
            if self.use_mtp:
                if K > 0:
                    self.mtp_pos[b] += self.pend_n[b]
                    self.pend_n[b] = n + 1
                else:
                    self.pend_n[b] += 1
            st_s = s.session.stats
            st_s.backbone_forwards += 1
            st_s.record_step(ks[b], n)
            st_s.time_draft += t_draft
            st_s.time_verify += t_verify
            kinds = ["draft"] * n + ["plain" if ks[b] == 0 else "bonus" if n == ks[b] else "correction"]
            toks = s.session.emit(out[b][: n + 1], kinds)
            if toks:
                emitted.append((s, toks))
        other = time.perf_counter() - t
        for s in seqs:
            s.session.stats.time_other += other
        return emitted

    def _round(self, D: int, cold: bool = False) -> list[tuple[Sequence, list[int]]]:
        """One round of the decoding rows [0, D). `cold`: a prompt chunk was read less than COLD_ROUNDS rounds before,
        so this round's time is not one the policy learns from."""
        model = self.model
        seqs = self.rows[:D]
        t0 = time.perf_counter()
        self.runner.begin_round()
        # the rows the round computes, which `auto` keys its round times by: a compiled graph's batch bucket; eager, the
        # decoding rows alone (a bucket's padding rows cost ~5% of an 8-row round each: a round of 5 rows ran as 8)
        B = bucket(D) if self.runner.compiled else D
        st = self._view(B)
        k = self.policy.next_k(D, cold, B, self.chain > 1) if self.use_mtp or self.masks is not None else 0
        ks = [max(0, min(k, s.session.max_new - len(s.session.new_tokens) - 1)) for s in seqs] + [0] * (B - D)
        if self.masks is not None:  # a row drafts only from a valid mask block
            ks = [min(a, b) for a, b in zip(ks, self.masks.limits(k, B))]
        # the round's width is the policy's k whatever fewer drafts the rows may use (one graph per k, not per remainder);
        # a round where no row may use a draft is a plain step
        K = k if max(ks) > 0 else 0
        dev = model.device
        rs = self._row_sampling(seqs, B)
        eager = not self.runner.compiled
        if self.use_mtp and K == 0 and max(self.pend_n[:D]) >= PENDING:  # a pending buffer is full: the MTP reads it
            # every decoding row with positions pending reads them in the same forward (it runs over every row anyway):
            # rows that joined at different times would otherwise fill up one after another and call for a catch-up
            # nearly every round (measured: 60 in 125 rounds of 8 rows, a quarter of the decoding time)
            rows = [b < D and self.pend_n[b] >= 2 for b in range(B)]
            t_catch = time.perf_counter()
            self.runner.catch_up(model, st, torch.tensor(rows, device=dev), self.mtp_pos[:B] if eager else None)
            t_catch = time.perf_counter() - t_catch
            for b in range(B):
                if rows[b]:
                    self.mtp_pos[b] += self.pend_n[b] - 1
                    self.pend_n[b] = 1
        else:
            t_catch = 0.0
        fused = None
        noise = (None,) * 3 if rs is None else self._noise(seqs, rs, B, K)  # (one draw a round, whichever path runs)
        # the whole round as one C call, where it can (greedy, and every shaping: step.c's picks and top_p.c)
        if eager and self.masks is None:
            head = None if K == 0 else self.vocab_head
            if K == 0 or self.vocab is None or head is not None:
                vocab = None if head is None else (head, self.vocab.ids)
                # a lone greedy sequence runs the rounds its k stands for (plain and a fixed k: all; `auto`: up to its
                # next probe) back to back in one call: the host's time between rounds was ~0.12 ms a round
                # (docs/decisions.md); the policy then learns from each round as it would have
                run = self.chain if self.policy.k_fixed is not None else min(self.chain, self.policy.run)
                if cold and self.policy.k_fixed is None:  # `auto`'s cold rounds chain among themselves: the rounds after
                    run = min(run, COLD_ROUNDS - self._since_chunk)  # them teach it round times again
                if run > 1 and B == 1 and rs is None and not (self.use_mtp and K == 0) and not seqs[0].session.stop:
                    chained = self._chain(seqs, K, st, vocab, run, cold)
                    if chained is not None:
                        return chained
                sampling = None if rs is None else (rs, *noise)
                fused = round_kernel.greedy_round(model, st, K, ks, D, self.state.cache.rows[:B],
                                                  max(self.pend_n[:B]) if K else 0, vocab, sampling)
        if fused is not None:
            out, t_draft, t_call = fused
            t_verify = time.perf_counter() - t0 - t_draft
        else:
            out, t_draft, t_verify = self._round_steps(st, K, ks, D, B, rs, noise, t0)
        if self.masks is not None:
            self.masks.commit(ks, [out[b][K + 1] for b in range(B)], D)
        emitted = self._kept(seqs, ks, K, out, t_draft, t_verify)
        # what `auto` learns a round costs: its wall time; where rounds chain, what the round costs in C (+ a catch-up),
        # as chained rounds are timed (`_chain`): the host's time around a single round is not what its k costs there
        seconds = None if self._first_call(B, K, rs) or cold else (
            t_call + t_catch if fused is not None and self.chain > 1 else time.perf_counter() - t0)
        self.policy.update(D, k, [(ks[b], out[b][K + 1]) for b in range(D)], seconds, B)
        self.last_round = [(s, ks[b], out[b][K + 1]) for b, s in enumerate(seqs)]
        return emitted

    def _first_call(self, B: int, K: int, rs: RowSampling | None) -> bool:
        """Whether this is the first round of its kind: a compiled graph's first call compiles it (or reads it from the
        disk cache), and an eager round's first of its kind (per model) builds what it runs (one-call programs, buffers:
        ~5x a round here); an eager decoder's state binds each width's one-call round on its first use
        (`round_kernel.greedy_round`: ~0.3 ms, the round ~2 ms, and `auto` learned those: int8 drafted k = 4 where
        k = 3 was faster): not times to learn from."""
        graph = (B, K, None if rs is None else (rs.use_penalty, rs.use_top_k, rs.use_top_p, rs.any_sampled, rs.any_unseeded))
        bound = self.state.__dict__.setdefault("rounds_run", set())
        first = graph not in self.runner.called or graph not in bound
        self.runner.called.add(graph)
        bound.add(graph)
        return first

    def _chain(self, seqs: list[Sequence], K: int, st: RoundState, vocab, run: int,
               cold: bool = False) -> list[tuple[Sequence, list[int]]] | None:
        """Up to `run` rounds of the one greedy row back to back in one call (`round_kernel.greedy_rounds`), at width K
        (a fixed k) or at `auto`'s k by the state each round starts in, each then kept, recorded and learned from as
        `_round` does one (`cold`: their times not learned) -> what they emitted."""
        s, pol = seqs[0].session, self.policy
        full = bool(pol.states) and pol.states[0] == AFTER_FULL
        ks = (K, K) if pol.k_fixed is not None else pol.by_state
        chained = round_kernel.greedy_rounds(self.model, st, ks, full, s.max_new - len(s.new_tokens),
                                             self.state.cache.rows[0], vocab, list(s.eos), run)
        if chained is None:
            return None
        rounds, seconds, t_draft = chained
        toks = []
        for (k, out), t in zip(rounds, seconds):
            n = out[k + 1]
            first = self._first_call(1, k, None)
            toks += [x for _, e in self._kept(seqs, [k], k, [out], t_draft / len(rounds), t - t_draft / len(rounds))
                     for x in e]
            pol.update(1, k, [(k, n)], None if first or cold else t, 1)
        pol.advance(len(rounds) - 1)
        self._since_chunk += len(rounds) - 1
        self.last_round = [(seqs[0], rounds[-1][0], rounds[-1][1][-1])]
        return [(seqs[0], toks)] if toks else []

