"""Validation metrics: backbone loss/accuracy, per-depth MTP loss/accuracy and expected acceptance.

Expected acceptance (greedy, teacher forced): the MTP depth-d argmax at position i equals the backbone's
argmax at position i+d (both predict token i+d+1).
- `accept_d`: that rate over all positions (marginal).
- `accept_pos_d`: P(depth d matches | depths 1..d-1 matched) at the same position, i.e. acceptance at draft
  position d as the decoder counts it (docs/architecture.md, "Statistics"), on positions where every depth is defined.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .loss import shifted_cross_entropy


@torch.no_grad()
def evaluate(model, batches: Iterable[torch.Tensor], depth: int | None = None) -> dict:
    """batches of ids [B, T] -> metrics dict (means weighted by valid tokens)."""
    was_training = model.training
    model.eval()
    if depth is None:
        depth = model.mtp.num_layers if model.mtp is not None else 0
    if model.mtp is None:
        depth = 0
    sums: dict[str, float] = {}

    def add(k: str, v: float, n: float) -> None:
        sums[k] = sums.get(k, 0.0) + v
        sums[k + "#n"] = sums.get(k + "#n", 0.0) + n

    for ids in batches:
        ids = ids.to(model.device)
        B, T = ids.shape
        h = model.hidden(ids)                                          # [B, T, H]
        logits = model.head(h)                                         # [B, T, V]
        loss, n = shifted_cross_entropy(logits, ids, 1)
        add("loss", loss.item() * n.item(), n.item())
        add("acc", (logits[:, :-1].argmax(-1) == ids[:, 1:]).sum().item(), B * (T - 1))
        base = logits.argmax(-1)                                        # [B, T]
        del logits
        if depth:
            m = T - depth                                               # positions where every depth exists
            chain = torch.ones(B, m, dtype=torch.bool, device=ids.device)
            for d, hd in enumerate(model.mtp_hidden_states(ids, depth, hidden=h), start=1):
                lg = model.mtp_head(hd, d)                              # [B, T-d, V]: i predicts i+d+1
                ld, nd = shifted_cross_entropy(lg, ids, d + 1)
                add(f"loss_{d}", ld.item() * nd.item(), nd.item())
                pred = lg.argmax(-1)                                    # [B, T-d]
                add(f"acc_{d}", (pred[:, :T - d - 1] == ids[:, d + 1:]).sum().item(), B * (T - d - 1))
                match = pred == base[:, d:]                             # [B, T-d]
                add(f"accept_{d}", match.sum().item(), match.numel())
                before = chain.sum().item()
                chain &= match[:, :m]
                add(f"accept_pos_{d}", chain.sum().item(), before)
    out = {k: (sums[k] / sums[k + "#n"] if sums[k + "#n"] else math.nan) for k in sums if not k.endswith("#n")}
    out["eval_tokens"] = int(sums.get("acc#n", 0.0))
    if depth:
        # expected tokens per backbone forward with `depth` greedy drafts (bonus token included)
        p, acc_len = 1.0, 1.0
        for d in range(1, depth + 1):
            p *= out[f"accept_pos_{d}"] if not math.isnan(out[f"accept_pos_{d}"]) else 0.0
            acc_len += p
        out["mean_accepted_length"] = acc_len
    model.train(was_training)
    return out
