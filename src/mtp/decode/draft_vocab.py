"""Reduced-vocabulary drafting: the MTP drafts over the N most frequent tokens only.

At real size a draft step's cost is mostly the output head (Qwen3.5-0.8B: 248,320 x 1024, several times the
MTP layer's work). Drafting over the N most frequent tokens cuts that work by V/N. Output stays exactly
lossless: the backbone verifies every draft with its full head, so a token outside the reduced vocabulary can
only be missed (a rejected or never-made draft), never emitted wrongly. For sampling, the draft distribution q
is the MTP's distribution restricted to the N tokens (shaped by temperature / top-k / top-p like p), which is
exactly the law the drafts are drawn from, so the acceptance rule stays exact.

The counts come from `token_frequencies.json` beside the model (written by `mtp data` for its train split and
copied into every model folder `mtp train` writes).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..model.argmax_kernel import argmax

FREQUENCIES = "token_frequencies.json"


class DraftVocab:
    """The token ids [N] drafts may take, and the MTP head's rows for them (built once per head)."""

    def __init__(self, token_ids: torch.Tensor | list[int], vocab_size: int):
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique()  # sorted: ties break as in the full argmax
        if ids.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token id")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"draft vocabulary token ids must lie in 0..{vocab_size - 1}")
        self.ids = ids
        self.vocab_size = vocab_size
        self._rows: dict[int, torch.Tensor] = {}

    @property
    def size(self) -> int:
        return self.ids.numel()

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int, always: list[int] = ()) -> DraftVocab:
        """The `size` most frequent ids of counts [V] (ids in `always`, e.g. EOS, are kept too)."""
        counts = torch.as_tensor(counts, dtype=torch.float64).clone()
        if not 1 <= size:
            raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
        for i in always:
            counts[i] = float("inf")
        return cls(torch.topk(counts, min(size, counts.numel())).indices, counts.numel())

    @classmethod
    def for_model(cls, model, size: int) -> DraftVocab:
        """The `size` most frequent tokens by the model folder's `token_frequencies.json`."""
        path = Path(model.source_path or ".") / FREQUENCIES
        if not path.exists():
            raise ValueError(f"--draft-vocab needs {FREQUENCIES} beside the model ({path} not found): `mtp data` writes "
                             "it into its data folder and `mtp train` copies it into the models it writes")
        counts = json.loads(path.read_text())["counts"]
        if len(counts) > model.config.vocab_size:
            raise ValueError(f"{path}: counts for {len(counts)} tokens, the model has {model.config.vocab_size}")
        counts = counts + [0] * (model.config.vocab_size - len(counts))
        return cls.from_counts(torch.tensor(counts), size, always=list(model.eos_token_ids))

    def prepare(self, model, depths: int) -> None:
        """Build the head rows of MTP depths 1..depths now (a compiled draft step cannot build them)."""
        for d in range(1, depths + 1):
            self._head_rows(model, d)

    def _head_rows(self, model, d: int) -> torch.Tensor:
        head = model.mtp_head_module(d)
        rows = self._rows.get(id(head))
        if rows is None or rows.device != model.device or rows.dtype != model.dtype:
            rows = self._rows[id(head)] = head.weight.detach()[self.ids.to(head.weight.device)].to(model.dtype).contiguous()
            self.ids = self.ids.to(model.device)
        return rows

    def logits(self, model, hidden: torch.Tensor, d: int) -> torch.Tensor:
        """MTP depth-d hidden [..., H] -> logits over the reduced vocabulary [..., N]."""
        return hidden @ self._head_rows(model, d).t()

    def argmax(self, model, hidden: torch.Tensor, d: int) -> torch.Tensor:
        """MTP depth-d hidden [B, H] -> the greedy draft [B] (a token id of the full vocabulary)."""
        return self.ids[argmax(self.logits(model, hidden, d))]

    def full_logits(self, model, hidden: torch.Tensor, d: int) -> torch.Tensor:
        """MTP depth-d hidden [B, H] -> full-vocabulary logits [B, V], -inf outside the reduced vocabulary."""
        reduced = self.logits(model, hidden, d)
        full = reduced.new_full((*reduced.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, reduced)
