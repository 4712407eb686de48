"""The drafter: the MTP module as a draft model, both schools behind one interface.

    drafts, q = drafter.draft(k)          # k proposals for the tokens after the last committed one
    drafter.commit(hidden, next_tokens)   # the backbone accepted these positions: hidden [1, n, H] and the
                                          # token that follows each of them

It owns the MTP layers' KV caches and their positions. Slot j of the first MTP layer holds (h_j, t_{j+1}) for
accepted positions only - exactly the teacher-forced depth-1 computation of training. `draft` first runs the
MTP over the positions committed since the last round (the catch-up, which also yields draft 1), then:
- sequential (Qwen3.5, DeepSeek-V3): drafts 2..k follow the causal chain, draft j embedded and fed with h^j
  to give draft j+1, in the slots after the last accepted one (overwritten by the next catch-up; layers are
  reused cyclically when k exceeds them);
- parallel (Meta's heads): every head catches up on every committed position, head d drafts token d.
`propose(logits, drafts_before) -> (token, q)` turns a row of MTP logits into a draft and its distribution
(q is None when drafting greedily with no penalty: the acceptance rule then needs no q). With a `DraftVocab`
the head is evaluated over its N tokens only (`draft_vocab.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .draft_vocab import DraftVocab

Propose = Callable[[torch.Tensor, list[int]], tuple[int, torch.Tensor | None]]


class Drafter:
    def __init__(self, model, max_len: int, propose: Propose, vocab: DraftVocab | None = None,
                 argmax_only: bool = False):
        """`argmax_only`: drafts are the plain argmax (greedy, no penalty), so no distribution is built."""
        if model.mtp is None:
            raise ValueError("this model has no MTP module to draft with")
        self.model = model
        self.mtp = model.mtp
        self.propose = propose
        self.vocab = vocab
        self.argmax_only = argmax_only
        self.caches = model.new_mtp_cache(1, max_len)
        self.pos = 0  # MTP slots 0..pos-1 hold accepted (h_j, t_{j+1}) entries
        self._hidden: torch.Tensor | None = None  # [1, m, H]: committed positions pos..pos+m-1 not yet caught up
        self._next: list[int] = []  # the token after each of them

    @property
    def max_depth(self) -> int | None:
        """The most drafts one round can make (None: no limit from the module)."""
        return self.mtp.max_depth

    def commit(self, hidden: torch.Tensor, next_tokens: list[int]) -> None:
        """The backbone kept these positions: their hidden states [1, n, H] and the token after each (n ids)."""
        if hidden.shape[1] != len(next_tokens):
            raise ValueError(f"commit: {hidden.shape[1]} hidden states but {len(next_tokens)} next tokens")
        self._hidden = hidden if self._hidden is None else torch.cat([self._hidden, hidden], dim=1)
        self._next += next_tokens

    def draft(self, k: int) -> tuple[list[int], list[torch.Tensor]]:
        """Catch up on the committed positions, then propose k tokens. Returns the drafts and, unless drafting
        on the greedy fast path, their distributions q [V] (one per draft)."""
        if self._hidden is None:
            raise RuntimeError("draft() before any commit()")
        model, mtp = self.model, self.mtp
        start, hidden = self.pos, self._hidden
        end = start + hidden.shape[1]  # the backbone's position: the last emitted token sits at `end`
        next_ids = torch.tensor([self._next], device=hidden.device)
        if mtp.style == "sequential":
            last = model.mtp_step(1, hidden, next_ids, start, self.caches)  # [1, m, H]: its last row drafts token 1
            heads = None
        else:  # every head catches up, whatever k is, so their caches stay complete for later rounds
            heads = [model.mtp_step(d, hidden, None, start, self.caches) for d in range(1, mtp.num_layers + 1)]
        self.pos, self._hidden, self._next = end, None, []

        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        for j in range(1, k + 1):  # draft j proposes the token at position end + j, from MTP depth j
            if heads is not None:
                h = heads[j - 1]
            elif j > 1:  # the causal chain: draft j-1 feeds depth j, in the slot after the previous step
                token = torch.tensor([[drafts[-1]]], device=last.device)
                last = model.mtp_step(j, last[:, -1:], token, end - 2 + j, self.caches)
                h = last
            else:
                h = last
            token, q = self._propose(h[0, -1], j, drafts)
            drafts.append(token)
            if q is not None:
                qs.append(q)
        return drafts, qs

    def _propose(self, h: torch.Tensor, d: int, drafts: list[int]) -> tuple[int, torch.Tensor | None]:
        """Depth-d hidden [H] -> (draft token, q [V] or None)."""
        if self.vocab is None:
            return self.propose(self.model.mtp_head(h, d), drafts)
        reduced = self.vocab.logits(self.model, h, d)  # [N]
        if self.argmax_only:
            return int(self.vocab.ids[reduced.argmax()]), None
        return self.propose(self.vocab.full_logits(reduced), drafts)
