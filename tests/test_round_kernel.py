"""The end of a greedy round as one C call (decode/round_kernel.py) leaves the round state exactly as the tensor form
in decode/round.py (`accept_and_keep`) does: tokens, counts, positions, last tokens, the MTP's slots and pending
positions, for K = 0 (a plain step: the pending position appended) and K > 0, rows at their limit, inactive rows,
and every draft accepted or none."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from mtp.decode import round as round_mod
from mtp.decode import round_kernel
from mtp.decode.round import PENDING, RoundState, accept_and_keep

pytestmark = pytest.mark.skipif(not round_kernel.LIBRARY.available(), reason="the C kernels are not available here")


def state(model, B: int, seed: int) -> RoundState:
    g = torch.Generator().manual_seed(seed)
    st = RoundState.allocate(model, B, 64, True, False)
    st.pos.copy_(torch.randint(0, 30, (B,), generator=g))
    st.last.copy_(torch.randint(0, 64, (B,), generator=g))
    st.mtp_pos.copy_(torch.randint(0, 20, (B,), generator=g))
    st.pend_n.copy_(torch.randint(1, PENDING + 1, (B,), generator=g))
    st.pend_next.copy_(torch.randint(0, 64, st.pend_next.shape, generator=g))
    st.pend_h.copy_(torch.randn(st.pend_h.shape, generator=g))
    return st


@pytest.mark.parametrize("K", [0, 1, 3, 8])
@pytest.mark.parametrize("with_mtp", [True, False])
def test_the_c_accept_leaves_the_state_the_tensor_form_leaves(K, with_mtp, monkeypatch):
    model = tiny_model(0).to(torch.bfloat16)
    B, V = 6, model.config.vocab_size
    g = torch.Generator().manual_seed(K)
    target = torch.randint(0, V, (B, K + 1), generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    for b, n in enumerate([0, 1, K, K // 2, K, 2]):  # rows whose drafts match the target's first n
        drafts[b, : min(n, K)] = target[b, : min(n, K)]
    limit = torch.tensor([K, K, max(K - 1, 0), K, K, 1])
    active = torch.tensor([True, True, True, False, True, True])
    logits = torch.nn.functional.one_hot(target, V).to(torch.bfloat16)  # its argmax is the target
    hidden = torch.randn(B, K + 1, model.config.hidden_size, generator=g).to(torch.bfloat16)
    results = []
    for c in (True, False):
        st = state(model, B, seed=K + 10)
        if not with_mtp:
            st.mtp_cache = st.mtp_pos = st.pend_h = st.pend_next = st.pend_n = None
        with monkeypatch.context() as m:
            if not c:
                m.setattr(round_mod.round_kernel, "usable", lambda *a: False)
            else:
                assert round_kernel.usable(st, drafts, hidden)
            tokens = accept_and_keep(st, [], hidden, logits, drafts, limit, active, None, None, None, None)
        results.append((tokens, st))
    (ta, sa), (tb, sb) = results
    assert torch.equal(ta, tb)
    for name in ("pos", "last", "mtp_pos", "pend_h", "pend_next", "pend_n"):
        a, b = getattr(sa, name), getattr(sb, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert ta[:, K + 1].tolist()[3] == 0  # the inactive row accepted nothing
