"""MTP self-speculative decoding: draft with the MTP module, verify in ONE backbone forward, accept,
roll back. Output equals plain decoding (greedy: the same tokens; sampling: the same distribution).

One round, with P tokens consumed by the backbone and t_P the last emitted token:
  1. draft   - catch-up + first draft in one MTP forward over the backbone hiddens not yet seen by
               the MTP (positions a..P-1, each paired with its next token), then k-1 chained steps:
               draft j is embedded and fed with h^{j-1} to give draft j+1 (the causal chain; layers
               reused cyclically). Parallel heads draft all k from h^0_{P-1} at once instead.
  2. verify  - one backbone forward over [t_P, d_1..d_k] (k+1 positions) recording DeltaNet states.
  3. accept  - `accept.py`: n drafts kept plus the target's own token at the first mismatch (or the
               bonus token when all k match).
  4. rollback- backbone: keep n+1 positions (DeltaNet state selected, KV slots overwritten later);
               MTP: chain slots past P-1 are overwritten by the next catch-up.
The MTP KV cache slot j holds (h_j, t_{j+1}) for accepted positions only, as in training (depth 1).
With mtp_num_hidden_layers > 1, layers after the first see only the draft entries of earlier rounds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .accept import accept_greedy, accept_sampling
from .generate import Session
from .policy import DraftPolicy

MAX_DRAFT = 8


def speculative_decode(session: Session, draft_tokens: int | str) -> Iterator[list[int]]:
    """Prefill, then draft/verify/accept rounds until a stop. Yields the tokens emitted per round."""
    model, stats, params = session.model, session.stats, session.params
    mtp = model.mtp
    policy = DraftPolicy.from_arg(draft_tokens, MAX_DRAFT if mtp.max_depth is None else min(MAX_DRAFT, mtp.max_depth))
    stats.draft_tokens_max = policy.k_max
    dev = model.device
    fast_greedy = session.plain_argmax

    t0 = time.perf_counter()
    max_len = len(session.tokens) + session.max_new + policy.k_max + 2
    cache = model.new_cache(1, max_len)
    mtp_cache = model.new_mtp_cache(1, max_len)
    hidden = model.hidden(torch.tensor([session.tokens], device=dev), cache)  # [1, P, H]
    first = session.choose(model.head(hidden[0, -1]))
    stats.prefill_forwards += 1
    stats.time_prefill = time.perf_counter() - t0
    out = session.emit([first])
    if out:
        yield out
    mtp_pos = 0  # MTP slots 0..mtp_pos-1 hold accepted (h_j, t_{j+1}) entries

    while not session.done:
        P = cache.pos
        remaining = session.max_new - len(session.new_tokens)
        k = max(0, min(policy.next_k(), remaining - 1))

        # 1. draft
        t = time.perf_counter()
        next_ids = torch.tensor([session.tokens[mtp_pos + 1 : P + 1]], device=dev)  # t_{j+1} for j = mtp_pos..P-1
        last = catch_up(model, mtp_cache, hidden, next_ids, mtp_pos)
        drafts: list[int] = []
        q_rows: list[torch.Tensor] = []
        for j in range(k):
            if mtp.style == "sequential":
                if j:  # the causal chain: draft j feeds step j+1
                    last = chain_step(model, mtp_cache, last, drafts[-1], depth=j + 1, pos=P - 1 + j)
                row = model.head(last[0, -1], for_mtp=True)
            else:
                row = model.head(last[j][0, -1], for_mtp=True)
            if fast_greedy:
                drafts.append(int(row.argmax()))
            else:
                q = session.probs(row, extra=drafts)
                q_rows.append(q)
                drafts.append(int(q.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=session.generator)))
        mtp_pos = P
        t_draft = time.perf_counter() - t
        stats.time_draft += t_draft

        # 2. verify: one backbone forward over [t_P, d_1..d_k]
        t = time.perf_counter()
        x = torch.tensor([[session.tokens[P]] + drafts], device=dev)
        cache.begin_verify(k + 1)
        h = model.hidden(x, cache)  # [1, k+1, H]
        logits = model.head(h[0])  # [k+1, V]
        stats.backbone_forwards += 1
        t_verify = time.perf_counter() - t
        stats.time_verify += t_verify

        # 3. accept
        t = time.perf_counter()
        if fast_greedy:
            n, nxt = accept_greedy(drafts, logits.argmax(-1).tolist())
        elif params.greedy:
            target = [int(session.probs(logits[j], extra=drafts[:j]).argmax()) for j in range(k + 1)]
            n, nxt = accept_greedy(drafts, target)
        else:
            p = torch.stack([session.probs(logits[j], extra=drafts[:j]) for j in range(k + 1)])
            q = torch.stack(q_rows) if q_rows else p[:0]
            n, nxt = accept_sampling(drafts, p, q, session.generator)

        # 4. rollback: keep t_P and the n accepted drafts
        cache.accept(n + 1)
        hidden = h[:, : n + 1]
        stats.record_step(k, n)
        policy.update(k, n, t_draft, t_verify)
        out = session.emit(drafts[:n] + [nxt])
        stats.time_other += time.perf_counter() - t
        if out:
            yield out


def catch_up(model, mtp_cache, hid: torch.Tensor, next_ids: torch.Tensor, start: int):
    """Feed the MTP the backbone hiddens of positions start..start+n-1 (hid [1, n, H]) with their next tokens
    (next_ids [1, n]), writing their KV slots. Sequential: returns h^1 [1, n, H] (its last row drafts
    token P+1). Parallel: returns [h^d for every head d], each [1, n, H] (head d drafts token P+d); every head
    catches up, whatever k this round drafts, so their caches stay complete for later rounds."""
    mtp = model.mtp
    cos, sin = model.rope(start, hid.shape[1])
    if mtp.style == "sequential":
        return mtp.step(1, hid, model.embed(next_ids, for_mtp=True), cos, sin, mtp_cache[0], start)
    return [mtp.step(d, hid, None, cos, sin, mtp_cache[d - 1], start) for d in range(1, mtp.num_layers + 1)]


def chain_step(model, mtp_cache, prev: torch.Tensor, token: int, depth: int, pos: int) -> torch.Tensor:
    """One chained MTP step: h^{depth-1} [1, >=1, H] (its last row) and the previous draft -> h^depth [1, 1, H],
    placed in slot `pos` of its layer's cache (the slot after the previous step, as vLLM does)."""
    cos, sin = model.rope(pos, 1)
    emb = model.embed(torch.tensor([[token]], device=prev.device), for_mtp=True)
    layer = model.mtp.layer_for_depth(depth)
    return model.mtp.step(depth, prev[:, -1:], emb, cos, sin, mtp_cache[layer], pos)
