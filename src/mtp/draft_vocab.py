"""Reduced-vocabulary draft head: the MTP drafts over the N most frequent tokens only.

At real size the draft step's cost is mostly the output head (Qwen3.5-0.8B: 248,320 x 1024, about as
much work as the rest of the MTP layer several times over). Drafting over the most frequent N tokens
cuts that work by V/N. Greedy output stays exactly lossless: the backbone verifies every draft with its
full head, so a draft outside the reduced vocabulary can only be *rejected*, never emitted. The cost is
acceptance: drafts that the full head would have made and the reduced one cannot.

Hook (greedy drafts): where the decode loop computes `int(model.head(h, for_mtp=True)[0, -1].argmax())`
for a draft, call `head.argmax(h)` of a `ReducedVocabHead` built once per model. Sampled drafts need a
proper q distribution over the full vocabulary (zero outside the subset) and are left out here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class ReducedVocabHead:
    """The rows of the MTP's output head for `token_ids`; `argmax(h)` returns a full-vocabulary token id."""

    def __init__(self, model, token_ids: torch.Tensor | list[int]):
        weight = model.mtp.lm_head.weight if model.mtp is not None and hasattr(model.mtp, "lm_head") else model.lm_head.weight
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=weight.device).unique()
        if ids.numel() == 0:
            raise ValueError("a reduced vocabulary needs at least one token id")
        if int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]:
            raise ValueError(f"token ids must lie in 0..{weight.shape[0] - 1}")
        self.token_ids = ids  # [N], sorted
        self.weight = weight.detach()[ids].contiguous()  # [N, H], a copy: the full head is untouched

    @property
    def size(self) -> int:
        return self.token_ids.numel()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> logits over the reduced vocabulary [..., N]."""
        return hidden @ self.weight.T

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> full-vocabulary ids [...] of the best token in the reduced vocabulary (last position
        of a [B, T, H] input gives [B, T])."""
        return self.token_ids[self.logits(hidden).argmax(-1)]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft for the last position: [1, T, H] -> a 0-dim id tensor."""
        return self.argmax(hidden[0, -1])

    @classmethod
    def from_counts(cls, model, counts: torch.Tensor, size: int) -> ReducedVocabHead:
        """Keep the `size` tokens with the highest counts ([V] tensor of token frequencies)."""
        size = min(size, counts.numel())
        return cls(model, torch.topk(counts.float(), size).indices)

    @classmethod
    def from_corpus(cls, model, token_lists: Iterable[list[int]], size: int,
                    always: Iterable[int] = ()) -> ReducedVocabHead:
        """Count token frequencies over tokenized texts (e.g. the training split); `always` ids are kept too."""
        counts = torch.zeros(model.config.vocab_size, dtype=torch.float64)
        for ids in token_lists:
            counts += torch.bincount(torch.as_tensor(ids, dtype=torch.long), minlength=counts.numel()).double()
        for i in always:
            counts[i] = float("inf")
        return cls.from_counts(model, counts, size)
