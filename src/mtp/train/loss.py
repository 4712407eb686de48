"""The MTP objective:  L = L_main + sum_d w_d * L_d.

- `shifted_cross_entropy`: the one shifted CE helper, normalised per valid token.
- `mtp_weights`: w_d for the schedules `deepseek` (lambda/D, lambda stepping 0.3 -> 0.1 after a token
  budget), `decay` (0.8^d, the seeds'), `constant`.
- `mtp_objective`: backbone + every depth, taken depth by depth (one depth's logits live at a time when
  `checkpoint_logits` is set: the head and CE are recomputed in backward, so only h^d is kept).
- `self_distill_loss`: KL(backbone || MTP) between the backbone's distribution at position i+d and the
  MTP depth-d distribution at position i (both predict token i+d+1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
SCHEDULES = ("deepseek", "decay", "constant")


def shifted_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, offset: int,
                          mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean CE over valid targets where position i of `logits` predicts `ids[:, i + offset]`.

    logits [B, N, V] (N >= T - offset; extra trailing positions have no target and are dropped),
    ids [B, T], mask [B, T] (True = a valid target token). Returns (loss, n_valid) with n_valid a
    0-dim tensor; loss is 0 (with grad) when nothing is valid.
    """
    T = ids.shape[1]
    n = T - offset
    if n <= 0:
        raise ValueError(f"offset {offset} leaves no targets in sequences of {T} tokens")
    if logits.shape[1] < n:
        raise ValueError(f"logits cover {logits.shape[1]} positions; offset {offset} over {T} tokens needs {n}")
    target = ids[:, offset:]
    if mask is not None:
        target = target.masked_fill(~mask[:, offset:].bool(), IGNORE)
    lg = logits[:, :n].float()
    total = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), target.reshape(-1), ignore_index=IGNORE, reduction="sum")
    n_valid = (target != IGNORE).sum()
    return total / n_valid.clamp(min=1), n_valid


def mtp_weights(schedule: str, depth: int, tokens_seen: int = 0, lam: float = 0.3, lam_late: float = 0.1,
                switch_tokens: int | None = None, decay: float = 0.8, constant: float = 1.0) -> list[float]:
    """w_1..w_depth for a schedule (see the module docstring)."""
    if schedule == "deepseek":
        lam_now = lam if switch_tokens is None or tokens_seen < switch_tokens else lam_late
        return [lam_now / depth] * depth
    if schedule == "decay":
        return [decay ** d for d in range(1, depth + 1)]
    if schedule == "constant":
        return [constant] * depth
    raise ValueError(f"mtp_schedule must be one of {SCHEDULES}, got {schedule!r}")


def _ce_from_hidden(model, h: torch.Tensor, ids: torch.Tensor, offset: int, mask, depth: int):
    logits = model.head(h) if depth == 0 else model.mtp_head(h, depth)
    return shifted_cross_entropy(logits, ids, offset, mask)


def head_ce(model, h: torch.Tensor, ids: torch.Tensor, offset: int, mask=None, depth: int = 0,
            checkpoint_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """CE of the head's logits (the backbone's for depth 0, MTP depth d's otherwise) against ids shifted by
    `offset`; with checkpoint_logits the [B, N, V] logits are not kept for backward (recomputed), so only
    h [B, N, H] stays alive."""
    if checkpoint_logits and torch.is_grad_enabled():
        return checkpoint(_ce_from_hidden, model, h, ids, offset, mask, depth, use_reentrant=False)
    return _ce_from_hidden(model, h, ids, offset, mask, depth)


def self_distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student); both [B, N, V] (teacher is detached)."""
    t = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    s = F.log_softmax(student_logits.float(), dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    return kl.mean()


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor            # the weighted total, to backpropagate
    main: torch.Tensor            # L_main, 0-dim and detached (read it after backward: no host sync inside a step)
    depths: list[torch.Tensor]    # L_d per depth, detached (CE to true tokens, or KL to the backbone in self-distillation)
    aux: torch.Tensor             # MoE load-balancing loss included in `loss` (coefficient applied), detached; 0 if none


def mtp_objective(model, ids: torch.Tensor, weights: list[float], mask: torch.Tensor | None = None,
                  train_backbone: bool = True, distill: bool = False,
                  checkpoint_logits: bool = False) -> ObjectiveOutput:
    """L = L_main + sum_d w_d L_d (+ the MoE load-balancing losses) on one batch ids [B, T] (teacher forced),
    depth by depth.

    train_backbone=False (`heads` mode): the backbone runs under no_grad and L_main is reported only.
    distill=True: L_d = KL(backbone at i+d || MTP depth d at i) instead of CE to the true token.
    MoE models add router_aux_loss_coef x the load-balancing loss of the backbone's routers (as transformers does)
    and, separately, of the MTP layer's routers over all depths.
    """
    depth = len(weights)
    aux = []
    if train_backbone:
        routers: list = []
        h = model.hidden(ids, router_logits=routers)                            # [B, T, H]
        main, _ = head_ce(model, h, ids, 1, mask, checkpoint_logits=checkpoint_logits)
        total = main
        main_val = main.detach()
        if (lb := model.router_aux_loss(routers)) is not None:
            aux.append(lb)
    else:
        with torch.no_grad():
            h = model.hidden(ids)
            teacher = model.head(h) if distill else None                        # [B, T, V]
            main_val = shifted_cross_entropy(teacher if distill else model.head(h), ids, 1, mask)[0]
        total = None
    losses = []
    if depth and model.mtp is not None:
        mtp_routers: list = []
        states = model.mtp_hidden_states(ids, depth, hidden=h, router_logits=mtp_routers)
        for d, (w, hd) in enumerate(zip(weights, states), start=1):
            # hd [B, T-d, H]: position i predicts token i+d+1
            if distill:
                if train_backbone:
                    raise ValueError("self-distillation is for heads mode (the backbone must be frozen)")
                ld = self_distill_loss(model.mtp_head(hd, d), teacher[:, d:])
            else:
                ld, _ = head_ce(model, hd, ids, d + 1, mask, depth=d, checkpoint_logits=checkpoint_logits)
            losses.append(ld.detach())
            total = w * ld if total is None else total + w * ld
        if (lb := model.router_aux_loss(mtp_routers)) is not None:
            aux.append(lb)
    if total is None:
        raise ValueError("nothing to train: heads mode needs an MTP module and mtp depth >= 1")
    aux_total = sum(aux) if aux else torch.zeros((), device=ids.device)
    return ObjectiveOutput(total + aux_total, main_val, losses, aux_total.detach())
