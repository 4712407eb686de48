"""Reduced-vocabulary drafting: the MTP drafts over the N most frequent tokens only.

At real size a draft step's cost is mostly the output head (Qwen3.5-0.8B: 248,320 x 1024, several times the
MTP layer's work). Drafting over the N most frequent tokens cuts that work by V/N. Output stays exactly
lossless: the backbone verifies every draft with its full head, so a token outside the reduced vocabulary can
only be missed (a rejected or never-made draft), never emitted wrongly. For sampling, the draft distribution q
is the MTP's distribution restricted to the N tokens (shaped by temperature / top-k / top-p like p), which is
exactly the law the drafts are drawn from, so the acceptance rule stays exact.

On the CPU in bf16 the reduced head is a prepared "bf16-native" layer (`DraftVocab.head`; int8 / int4 where the drafts
are quantized, `CausalLM.quantize_drafts`, or the full head is), which the model's one-call draft chain reads too
(`CausalLM.mtp_draft`), so the chain runs in C with the step-by-step chain's drafts.

The counts come from `token_frequencies.json` beside the model (written by `mtp data` for its train split and
copied into every model folder `mtp train` writes). The command line drafts over the most frequent tokens that make
AUTO_COVERAGE of them by default (`--draft-vocab auto`, `auto_size`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..model.argmax_kernel import argmax
from ..model.linear import FastLinear, quantized_kernel

FREQUENCIES = "token_frequencies.json"
# `--draft-vocab auto`: the fewest most frequent tokens that make this share of the training tokens. On the shipped
# model (8,192 tokens) the 4,096 most frequent make 94.8% and left the bench prompts' accepted drafts as they were
# (618 against 619 at k = 3, int4) while k = 3 ran 6% faster (bf16 and int8 5-7%); the 2,048 most frequent (88%)
# lost 5% of them (docs/decisions.md, 2026-12-06 sixth session).
AUTO_COVERAGE = 0.95


def _path(model) -> Path:
    return Path(model.source_path or ".") / FREQUENCIES


def _counts(model) -> list[int] | None:
    """The counts [V] of the model folder's `token_frequencies.json` (missing ids 0), or None where it has none."""
    path = _path(model)
    if not path.exists():
        return None
    counts = json.loads(path.read_text())["counts"]
    if len(counts) > model.config.vocab_size:
        raise ValueError(f"{path}: counts for {len(counts)} tokens, the model has {model.config.vocab_size}")
    return counts + [0] * (model.config.vocab_size - len(counts))


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
        self._rows: dict[int, tuple[torch.Tensor, int]] = {}  # per head module: its rows for the ids [N, H], and the
        # version of the weight they were taken from (a weight changed in place - training, healing - is taken again)
        self._heads: dict[int, FastLinear] = {}  # per head module: those rows as a prepared layer (`head`)

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
        """The `size` most frequent tokens by the model folder's `token_frequencies.json`, made once per model, file and
        size (kept on the model: each `generate(draft_vocab=N)` made and prepared its own, ~6 ms a call on the shipped
        model, 8% of a 128-token generation at k = 3)."""
        path = _path(model)
        key = (size, str(path), path.stat().st_mtime_ns if path.exists() else None)
        made = model.__dict__.setdefault("_draft_vocabs", {})
        if key not in made:
            counts = _counts(model)
            if counts is None:
                raise ValueError(f"--draft-vocab needs {FREQUENCIES} beside the model ({path} not found): `mtp data` "
                                 "writes it into its data folder and `mtp train` copies it into the models it writes")
            made[key] = cls.from_counts(torch.tensor(counts), size, always=list(model.eos_token_ids))
        return made[key]

    @staticmethod
    def auto_size(model) -> int | None:
        """`--draft-vocab auto`: the fewest most frequent tokens that make AUTO_COVERAGE of the counted ones (rounded up
        to a multiple of 64, as the heads' kernels take them), or None - the full vocabulary - where the model folder
        has no `token_frequencies.json` or they would be more than 3/4 of the vocabulary (little to gain)."""
        counts = _counts(model)
        if counts is None or sum(counts) <= 0:
            return None
        made = torch.tensor(sorted(counts, reverse=True), dtype=torch.float64).cumsum(0)
        n = int((made < AUTO_COVERAGE * made[-1]).sum()) + 1  # (the first count at which the share is made)
        n = -(-n // 64) * 64
        return n if n <= 3 * len(counts) // 4 else None

    def prepare(self, model, depths: int) -> None:
        """Build the head rows of MTP depths 1..depths now (a compiled draft step cannot build them)."""
        for d in range(1, depths + 1):
            self._head_rows(model, d)
            self.head(model, d)

    def _head_rows(self, model, d: int) -> torch.Tensor:
        head = model.mtp_head_module(d)
        rows, version = self._rows.get(id(head), (None, None))
        if rows is None or rows.device != model.device or rows.dtype != model.dtype or version != head.weight._version:
            with torch.inference_mode(False):  # a normal tensor: `head`'s layer takes it as its weight
                rows = head.weight.detach()[self.ids.to(head.weight.device)].to(model.dtype).contiguous()
            self._rows[id(head)] = rows, head.weight._version
            self.ids = self.ids.to(model.device)
            self._heads.pop(id(head), None)
        return rows

    def head(self, model, d: int) -> FastLinear | None:
        """MTP depth d's head over the reduced vocabulary as a prepared bf16 linear layer [H] -> [N] (qmatmul's bf16
        product where it runs: what the model's one-call draft chain reads, `CausalLM.mtp_draft`), or None where the
        model does not run prepared kernels (off the CPU, not bf16): `logits` then multiplies by the rows."""
        if model.device.type != "cpu" or model.dtype != torch.bfloat16 or not model.prepared:
            return None
        rows = self._head_rows(model, d)
        head = model.mtp_head_module(d)
        layer = self._heads.get(id(head))
        if layer is None:
            # the drafts' precision, else the head's own: an int4 model's reduced head in bf16 read 4x the bytes a row
            # its full head reads (at the Qwen3.5-0.8B shape, 32k rows cost half of the 248k-row int4 head)
            bits = model.draft_quantize or (head.kernel if isinstance(head, FastLinear) and head.kernel in ("int8", "int4") else None)
            layer = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
            with torch.inference_mode(False), torch.no_grad():
                layer.weight = torch.nn.Parameter(rows, requires_grad=False)  # (the rows themselves: no second copy)
                FastLinear.wrap(layer, quantized_kernel(bits, layer) if bits else "bf16-native")
            self._heads[id(head)] = layer
        return layer

    def logits(self, model, hidden: torch.Tensor, d: int) -> torch.Tensor:
        """MTP depth-d hidden [..., H] -> logits over the reduced vocabulary [..., N]."""
        layer = self.head(model, d)
        return hidden @ self._head_rows(model, d).t() if layer is None else layer(hidden)

    def argmax(self, model, hidden: torch.Tensor, d: int) -> torch.Tensor:
        """MTP depth-d hidden [B, H] -> the greedy draft [B] (a token id of the full vocabulary)."""
        return self.ids[argmax(self.logits(model, hidden, d))]

    def full_logits(self, model, hidden: torch.Tensor, d: int) -> torch.Tensor:
        """MTP depth-d hidden [B, H] -> full-vocabulary logits [B, V], -inf outside the reduced vocabulary."""
        reduced = self.logits(model, hidden, d)
        full = reduced.new_full((*reduced.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, reduced)
