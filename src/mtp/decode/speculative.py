"""MTP self-speculative decoding, one round top to bottom: draft, verify, accept, roll back.

Output equals plain decoding (greedy: the same tokens; sampling: the same distribution). With P tokens
consumed by the backbone and t_P the last emitted token, one round is:

  1. draft    - `Drafter.draft(k)`: the MTP catches up on the positions accepted last round (one forward that
                also yields draft 1), then drafts 2..k along the causal chain (or parallel heads all at once).
  2. verify   - `model.verify([t_P, d_1..d_k], cache)`: ONE backbone forward over k+1 positions that returns
                their hidden states and the per-position DeltaNet states rollback may need.
  3. accept   - `accept.py`: the n drafts that match, plus the backbone's own token at the first mismatch (or
                the bonus token when all k match).
  4. rollback - `cache.keep(verified, n + 1)`: attention entries are addressed by position (nothing to undo),
                DeltaNet states are selected at the kept position, never recomputed. The drafter is told which
                positions were kept (`commit`); its chain slots past them are overwritten next round.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from .accept import accept_greedy, accept_sampling
from .draft_vocab import DraftVocab
from .drafter import Drafter
from .policy import DraftPolicy
from .prefill import prefill
from .session import Session

MAX_DRAFT = 8


def accept(session: Session, drafts: list[int], q_rows: list[torch.Tensor], logits: torch.Tensor) -> tuple[int, int]:
    """The acceptance rule for one sequence: its k drafts, their draft distributions (empty on the greedy fast path)
    and the verify logits [k+1, V] -> (drafts accepted n, the next token: correction or bonus). Unseeded sampling
    uses Leviathan et al.'s rule; seeded sampling the Gumbel-max coupling (`Session.gumbel`), also exact."""
    k = len(drafts)
    if session.plain_argmax:
        return accept_greedy(drafts, logits[: k + 1].argmax(-1).tolist())
    if session.params.greedy:
        return accept_greedy(drafts, [int(session.probs(logits[j], extra=drafts[:j]).argmax()) for j in range(k + 1)])
    if session.seeded:  # Gumbel-max: the target's own sample at each position, fixed by the seed; drafts must equal it
        at = len(session.tokens)
        return accept_greedy(drafts, [session.gumbel_pick(session.probs(logits[j], extra=drafts[:j]), at + j)
                                      for j in range(k + 1)])
    p = torch.stack([session.probs(logits[j], extra=drafts[:j]) for j in range(k + 1)])
    q = torch.stack(q_rows) if q_rows else p[:0]
    return accept_sampling(drafts, p, q, session.generator)


def speculative_decode(session: Session, draft_tokens: int | str, vocab: DraftVocab | None = None) -> Iterator[list[int]]:
    """Prefill, then draft/verify/accept/rollback rounds until a stop. Yields the tokens emitted per round.
    `vocab`: draft over a reduced vocabulary (the backbone still verifies over the full one)."""
    model, stats = session.model, session.stats
    depth_limit = model.mtp.max_depth
    policy = DraftPolicy.from_arg(draft_tokens, MAX_DRAFT if depth_limit is None else min(MAX_DRAFT, depth_limit))
    stats.draft_tokens_max = policy.k_max
    dev = model.device

    # prefill: the backbone reads the prompt; its hidden states are the drafter's first commit
    t0 = time.perf_counter()
    max_len = len(session.tokens) + session.max_new + policy.k_max + 2
    cache = model.new_cache(1, max_len)
    drafter = Drafter(model, max_len, session.propose, vocab, argmax_only=session.plain_argmax)
    prompt = list(session.tokens)
    hidden = prefill(model, prompt, cache)  # [1, P, H]
    first = session.choose(model.head(hidden[0, -1]))
    drafter.commit(hidden, prompt[1:] + [first])
    stats.prefill_forwards += 1
    stats.time_prefill = time.perf_counter() - t0
    out = session.emit([first], ["prefill"])
    if out:
        yield out

    while not session.done:
        P = cache.pos
        remaining = session.max_new - len(session.new_tokens)
        k = max(0, min(policy.next_k(), remaining - 1))

        # 1. draft
        t = time.perf_counter()
        drafts, q_rows = drafter.draft(k)
        t_draft = time.perf_counter() - t
        stats.time_draft += t_draft

        # 2. verify: one backbone forward over [t_P, d_1..d_k]
        t = time.perf_counter()
        verified = model.verify(torch.tensor([[session.tokens[P]] + drafts], device=dev), cache)
        logits = model.head(verified.hidden[0])  # [k+1, V]
        stats.backbone_forwards += 1
        t_verify = time.perf_counter() - t
        stats.time_verify += t_verify

        # 3. accept
        t = time.perf_counter()
        n, nxt = accept(session, drafts, q_rows, logits)

        # 4. rollback: keep t_P and the n accepted drafts
        cache.keep(verified, n + 1)
        drafter.commit(verified.hidden[:, : n + 1], drafts[:n] + [nxt])
        stats.record_step(k, n)
        # the first round's draft time includes the MTP reading the whole prompt: not a draft cost
        policy.update(k, n, t_draft if stats.backbone_forwards > 1 else None, t_verify)
        out = session.emit(drafts[:n] + [nxt], ["draft"] * n + ["plain" if k == 0 else "bonus" if n == k else "correction"])
        stats.time_other += time.perf_counter() - t
        if out:
            yield out
