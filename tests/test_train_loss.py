"""The MTP objective: the shifted CE helper, weight schedules, depth-by-depth memory option, both schools."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from mtp.train.loss import mtp_objective, mtp_weights, self_distill_loss, shifted_cross_entropy


def test_shifted_ce_toy_sequence_with_mask():
    V = 5
    ids = torch.tensor([[1, 2, 3, 4]])
    logits = torch.zeros(1, 4, V)
    logits[0, 0, 2] = 10.0   # position 0 predicts ids[1] = 2: nearly free
    # offset 1: targets 2, 3, 4 at positions 0..2; position 3 has no target and is dropped
    loss, n = shifted_cross_entropy(logits, ids, 1)
    uniform = math.log(V)
    p0 = -torch.log_softmax(logits[0, 0], -1)[2].item()
    assert n.item() == 3 and loss.item() == pytest.approx((p0 + 2 * uniform) / 3, rel=1e-6)
    mask = torch.tensor([[True, True, False, True]])                     # token 3 (index 2) is padding
    loss_m, n_m = shifted_cross_entropy(logits, ids, 1, mask)
    assert n_m.item() == 2 and loss_m.item() == pytest.approx((p0 + uniform) / 2, rel=1e-6)
    # offset 2 (MTP depth 1): logits of T-1 positions, targets ids[2:]
    loss2, n2 = shifted_cross_entropy(torch.zeros(1, 3, V), ids, 2)
    assert n2.item() == 2 and loss2.item() == pytest.approx(uniform)
    with pytest.raises(ValueError, match="offset"):
        shifted_cross_entropy(logits, ids, 4)


def test_weight_schedules():
    assert mtp_weights("deepseek", 2) == [0.15, 0.15]
    assert mtp_weights("deepseek", 1, tokens_seen=10, switch_tokens=10) == [0.1]
    assert mtp_weights("deepseek", 1, tokens_seen=9, switch_tokens=10) == [0.3]
    assert mtp_weights("decay", 3) == pytest.approx([0.8, 0.64, 0.512])
    assert mtp_weights("constant", 2, constant=0.5) == [0.5, 0.5]
    with pytest.raises(ValueError, match="mtp_schedule"):
        mtp_weights("linear", 1)


@pytest.mark.parametrize("style,layers,depth", [("sequential", 1, 3), ("parallel", 2, 2)])
def test_objective_is_sum_of_depth_losses(style, layers, depth):
    model = tiny_model(mtp_style=style, mtp_num_hidden_layers=layers).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    w = mtp_weights("decay", depth)
    out = mtp_objective(model, ids, w)
    ref = shifted_cross_entropy(model(ids), ids, 1)[0]
    logits = model.mtp_logits(ids, depth)
    for d, (wd, lg) in enumerate(zip(w, logits), start=1):
        ld = shifted_cross_entropy(lg, ids, d + 1)[0]
        assert float(out.depths[d - 1]) == pytest.approx(ld.item(), rel=1e-5)
        ref = ref + wd * ld
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_checkpoint_logits_same_loss_and_grads():
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    grads = []
    for ckpt in (False, True):
        model = tiny_model(seed=3, mtp_num_hidden_layers=1).train()
        out = mtp_objective(model, ids, [0.3, 0.3], checkpoint_logits=ckpt)
        out.loss.backward()
        grads.append((out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    for n, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][n], g, rtol=1e-5, atol=1e-6, msg=n)


def test_self_distillation_targets_the_backbone_at_i_plus_d():
    t = torch.randn(2, 5, 7)
    assert self_distill_loss(t, t).item() == pytest.approx(0.0, abs=1e-6)
    assert self_distill_loss(torch.randn(2, 5, 7), t).item() > 0
    model = tiny_model(seed=4)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    out = mtp_objective(model, ids, [1.0], train_backbone=False, distill=True)
    with torch.no_grad():
        teacher = model(ids)[:, 1:]                                       # backbone at i+1 predicts i+2
        student = model.mtp_logits(ids, 1)[0]                             # MTP depth 1 at i predicts i+2
    assert float(out.depths[0]) == pytest.approx(self_distill_loss(student, teacher).item(), rel=1e-5)
    with pytest.raises(ValueError, match="heads mode"):
        mtp_objective(model, ids, [1.0], train_backbone=True, distill=True)
