"""Mask-block drafting (`model/masks.py`): the drafts of round r+1 come from the mask tokens of round r's forward.

Every verify forward carries, after each row's own block [last, d_1..d_{K_b}], the k mask tokens (their positions
follow the row's last draft), then filler up to the common width:

    row b:  last  d_1 .. d_{K_b}  m_1 .. m_k  (filler)          ONE backbone forward, K+1+k tokens per row
            └─ verified as usual ─┘└ drafts ┘

Ordinary tokens never see a mask (each attends to the positions before it, and the masks come after them) and the
gated LoRA leaves their computation untouched, so the verify is exactly the one a plain round computes: lossless by
construction. When row b accepts all its K_b drafts, its next token (the bonus, or the plain step's token when K_b = 0)
sits right before the masks, so their hidden states are the right ones for the next k drafts: the sampler head chains
them from that token (`MaskAdapter.draft_logits`). When it rejects one, the masks followed rejected tokens: the next
round drafts nothing for that row and its forward carries a fresh mask block (the paper's "linear" decoding; its
"quadratic" decoding, a mask block after every draft, needs attention between tokens of the same position, which a
position-addressed cache does not hold). The masks' cache entries lie past the row's kept position and are
overwritten before anything reads them, like every slot past a sequence's end.
"""

from __future__ import annotations

import torch

from ..model.argmax_kernel import argmax
from .sampling import RowSampling, shape_logits


class MaskDrafter:
    """The mask block's state for `rows` rows: the hidden states at the masks of the last forward [rows, k, H] and
    whether they can draft (the row accepted its whole block); the host mirror `valid_host` sets each row's k."""

    def __init__(self, model, rows: int):
        self.adapter = model.masks
        self.k = self.adapter.config.masks
        dev = model.device
        self.mask_ids = torch.tensor(self.adapter.config.mask_ids, device=dev)  # [k]
        self.hidden = torch.zeros(rows, self.k, model.config.hidden_size, dtype=model.dtype, device=dev)
        self.valid_host = [False] * rows
        self._offset: torch.Tensor | None = None

    # ------------------------------------------------------------------ rows
    def reset_row(self, b: int) -> None:
        self.valid_host[b] = False

    def move(self, src: int, dst: int) -> None:
        self.hidden[dst] = self.hidden[src]
        self.valid_host[dst] = self.valid_host[src]

    def limits(self, k: int, rows: int) -> list[int]:
        """Drafts each of the first `rows` rows can make this round (k where its mask block is valid, else 0)."""
        return [k if self.valid_host[b] else 0 for b in range(rows)]

    # ------------------------------------------------------------------ the round
    def draft(self, model, st, K: int, rs: RowSampling | None, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts [B, K] from the mask hidden states of the last forward, chained by the sampler head from each row's
        last token; and, for unseeded sampling rows, their shaped logits [B, K, V] (as `round.draft`)."""
        B = st.last.shape[0]
        z = self.hidden[:B, :K]
        last = st.last
        drafts, shaped = [], []
        for j in range(K):
            s = self.adapter.sampler(z[:, j], model.model.embed_tokens(last).to(z.dtype))
            logits = model.head(s)  # [B, V]
            if rs is None:
                pick = argmax(logits)
            else:
                x = shape_logits(logits[:, None], rs, None)[:, 0]
                pick = argmax(x if noise is None else torch.where(rs.greedy[:, None], x, x + noise[:, j]))
                shaped.append(x)
            drafts.append(pick)
            last = pick
        drafts_t = torch.stack(drafts, 1) if drafts else torch.zeros(B, 0, dtype=torch.long, device=st.last.device)
        return drafts_t, (torch.stack(shaped, 1) if shaped and rs is not None and rs.any_unseeded else None)

    def ids(self, last: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        """The forward's tokens [B, K+1+k]: row b = last, its first limit[b] drafts, the k masks, then filler (the
        last mask again)."""
        B, K = drafts.shape
        slot = torch.arange(K + 1 + self.k, device=last.device)[None]  # [1, W]
        block = torch.cat([last[:, None], drafts, self.mask_ids[-1:].expand(B, self.k)], dim=1)  # [B, W]
        offset = limit[:, None] + 1  # where row b's masks start
        which = (slot - offset).clamp(0, self.k - 1)
        is_mask = (slot >= offset) & (slot < offset + self.k)
        self._offset = offset
        return torch.where(is_mask, self.mask_ids[which], torch.where(slot < offset, block, self.mask_ids[-1]))

    def read(self, hidden: torch.Tensor) -> None:
        """Keep the hidden states at each row's masks from the forward's hidden [B, K+1+k, H]."""
        B = hidden.shape[0]
        idx = (self._offset + torch.arange(self.k, device=hidden.device)[None])  # [B, k]
        self.hidden[:B].copy_(hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1])))

    def commit(self, limits: list[int], accepted: list[int], active: int) -> None:
        """After the round: a row can draft next round iff it accepted every draft it made (host lists)."""
        for b in range(len(self.valid_host)):
            self.valid_host[b] = b < active and accepted[b] == limits[b]
