"""The end of a greedy round as one C call (`round.c`): round.py's `verify` hands it the verify's argmax when every
row is greedy with no logit shaping and nothing rides along, on the CPU, eagerly. It leaves the round state exactly as
the tensor form below it in round.py does (tests/test_round_kernel.py), in one call instead of ~35 tensor operations
of a few values each (~0.3 ms a round on the shipped model, docs/decisions.md). Built and loaded as model/native.py
describes; MTP_NATIVE=0 (or no compiler) keeps the tensor form.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.base import PickRule
from ..model.native import NativeLibrary

p, i64 = ctypes.c_void_p, ctypes.c_int64


class _Round(ctypes.Structure):
    _fields_ = ([(n, i64) for n in ("B", "K", "PR", "hbytes")]
                + [(n, p) for n in ("target", "drafts", "limit", "active", "hidden", "pos", "last", "mtp_pos",
                                    "pend_next", "pend_n", "pend_h", "keep", "out", "seen")] + [("V", i64)])


class _Greedy(ctypes.Structure):
    _fields_ = ([("acc", _Round)] + [(n, i64) for n in ("R", "P")]
                + [(n, p) for n in ("ids", "index", "cos", "sin", "table_cos", "table_sin", "kernels", "verify", "step",
                                    "layers")]
                + [("L", i64)] + [(n, p) for n in ("head", "logits", "draft", "draft_args", "draft_layers")]
                + [("draft_L", i64)] + [(n, p) for n in ("keep", "keep_layers")]
                + [(n, i64) for n in ("keep_L", "nth", "stage", "draft_ns", "round_ns")] + [("pick", p)])


def _declare(lib: ctypes.CDLL) -> None:
    lib.accept_greedy.argtypes = [ctypes.POINTER(_Round)]
    lib.accept_greedy.restype = None
    lib.greedy_round.argtypes = [ctypes.POINTER(_Greedy)]
    lib.greedy_round.restype = ctypes.c_int
    lib.greedy_rounds.argtypes = [p, i64, i64, p, i64, i64, i64, i64, p, p, p, p, p, p]
    lib.greedy_rounds.restype = ctypes.c_int


LIBRARY = NativeLibrary(Path(__file__).with_name("round.c"), None, "the round's accept runs as tensor operations",
                        _declare)


def usable(st, drafts: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Can `accept_greedy` run on round state `st` (`RoundState`) with drafts [B, K] and the verify's hidden states
    [B, K+1, H] here (CPU tensors, eager)?"""
    B, K = drafts.shape
    ints = [drafts, st.pos, st.last] + ([st.mtp_pos, st.pend_next, st.pend_n] if st.mtp_cache is not None else [])
    seen = st.seen
    return (not torch.compiler.is_compiling() and LIBRARY.available()
            and (seen is None or (seen.dtype == torch.bool and seen.shape[0] == B and seen.is_contiguous()
                                  and seen.device.type == "cpu"))
            and all(t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous() for t in ints)
            and hidden.shape[:2] == (B, K + 1) and hidden.is_contiguous() and hidden.device.type == "cpu"
            and st.pos.shape == (B,) and (st.mtp_cache is None or (st.pend_h.dtype == hidden.dtype and st.pend_h.is_contiguous()
                                                                   and K + 1 <= st.pend_h.shape[1])))


def accept_greedy(st, target: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor, active: torch.Tensor,
                  hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where `usable`: for round state `st` and the verify's argmax target [B, K+1] (long), drafts [B, K], limit [B],
    active [B] (bool) and hidden states [B, K+1, H], accept, emit and update the state as round.py's `accept_and_keep`
    does -> (tokens [B, K+2]: the emitted tokens then n, keep [B]: the positions each row keeps, for `Cache.keep_at`)."""
    B, K = drafts.shape
    target, limit, active = (t.to(dt).contiguous() for t, dt in ((target, torch.int64), (limit, torch.int64),
                                                                   (active, torch.bool)))
    if target.shape != (B, K + 1) or limit.shape != (B,) or active.shape != (B,):
        raise ValueError(f"accept_greedy: target {list(target.shape)}, limit {list(limit.shape)}, active "
                         f"{list(active.shape)} for {B} rows of {K} drafts")
    out = torch.empty(B, K + 2, dtype=torch.int64)
    keep = torch.empty(B, dtype=torch.int64)
    r = _round(st, K, hidden, target.data_ptr(), drafts.data_ptr(), limit.data_ptr(), active.data_ptr(), keep.data_ptr(),
               out.data_ptr())
    LIBRARY.lib().accept_greedy(ctypes.byref(r))
    return out, keep


def _round(st, K: int, hidden: torch.Tensor, target: int, drafts: int, limit: int, active: int, keep: int,
           out: int) -> _Round:
    """`accept_greedy`'s arguments over round state `st` and the verify's hidden states [B, K+1, H] (the other
    buffers by address)."""
    mtp = st.mtp_cache is not None
    return _Round(st.pos.shape[0], K, st.pend_h.shape[1] if mtp else 0, hidden.shape[-1] * hidden.element_size(),
                  target, drafts, limit, active, hidden.data_ptr(), st.pos.data_ptr(), st.last.data_ptr(),
                  *((st.mtp_pos.data_ptr(), st.pend_next.data_ptr(), st.pend_n.data_ptr(), st.pend_h.data_ptr())
                    if mtp else (None,) * 4), keep, out, None if st.seen is None else st.seen.data_ptr(),
                  0 if st.seen is None else st.seen.shape[1])


@dataclass
class _Plan:
    """A bound greedy round (`greedy_round`): the model's `RoundProgram`, round.c's struct over it and the state, and
    the per-round inputs it points at (ctypes arrays: set from the host without tensor operations)."""

    program: object  # model/step.py RoundProgram
    call: _Greedy
    limit: ctypes.Array
    active: ctypes.Array
    out: ctypes.Array
    keep: ctypes.Array
    outs: ctypes.Array | None = None  # `greedy_rounds`' tokens and times of each round, grown as asked


def _plan(model, st, K: int, commit: bool, vocab, scratch) -> _Plan | None:
    B = st.pos.shape[0]
    mtp = st.mtp_cache is not None
    if K and not mtp:
        return None
    prog = model.round_program(K, commit, st.cache, st.mtp_cache, st.pos, st.pend_h, st.pend_next, st.pend_n,
                               st.mtp_pos, vocab, scratch)
    if prog is None or not usable(st, prog.drafts, prog.hidden):  # (the state as accept_greedy needs it)
        return None
    limit, out, keep = (ctypes.c_int64 * B)(), (ctypes.c_int64 * (B * (K + 2)))(), (ctypes.c_int64 * B)()
    active = (ctypes.c_uint8 * B)()
    addr = ctypes.addressof
    acc = _round(st, K, prog.hidden, prog.target.data_ptr(), prog.drafts.data_ptr(), addr(limit), addr(active),
                 addr(keep), addr(out))
    table_cos, table_sin = prog.table
    call = _Greedy(acc, table_cos.shape[-1], table_cos.shape[0], prog.ids.data_ptr(), prog.index.data_ptr(),
                   prog.cos.data_ptr(), prog.sin.data_ptr(), table_cos.data_ptr(), table_sin.data_ptr(), prog.kernels,
                   prog.verify, addr(prog.step), addr(prog.layers), len(prog.layers), addr(prog.verify_prog.head),
                   prog.logits.data_ptr(), prog.draft, None if prog.draft_args is None else addr(prog.draft_args),
                   None if prog.draft_layers is None else addr(prog.draft_layers),
                   0 if prog.draft_layers is None else len(prog.draft_layers), prog.keep,
                   None if prog.keep_layers is None else addr(prog.keep_layers),
                   0 if prog.keep_layers is None else len(prog.keep_layers), 1, 0, 0, 0)
    return _Plan(prog, call, limit, active, out, keep)


def _bound(model, st, K: int, commit: bool, vocab) -> _Plan | None:
    """The state's plan of a round of K drafts (bound on first use, rebound when the model's programs change), or None
    where the round cannot run as one call."""
    if not LIBRARY.available():
        return None
    plans = st.__dict__.setdefault("greedy_plans", {})  # (K, commit, draft head) -> _Plan, or None: it cannot
    key = (K, commit, None if vocab is None else id(vocab[0]))
    plan = plans.get(key, False)
    if plan is False or (plan is not None and not plan.program.current(model)):
        plans.pop(key, None)

        def scratch(n: int) -> torch.Tensor:
            # the plans of this state share one buffer (one round runs at a time); a larger one drops the plans bound to
            # the old (they hold it while they live), so it is taken twice as large as asked: `auto` going from k = 3 to
            # 6 then binds each width once instead of binding every narrower one again (~0.3 ms a plan, shipped model)
            arena = st.__dict__.get("greedy_scratch")
            if arena is None or arena.numel() < n:
                plans.clear()
                st.__dict__["greedy_scratch"] = arena = torch.empty(2 * n, dtype=torch.uint8)
            return arena

        plans[key] = plan = _plan(model, st, K, commit, vocab, scratch)
    return plan


def greedy_round(model, st, K: int, limits: list[int], decoding: int, starts: list[int], width: int,
                 vocab=None, sampling=None) -> tuple[list[list[int]], float, float] | None:
    """round.py's `draft` then `verify` of a greedy round with no shaping (every row greedy, the argmax drafts, nothing
    riding along, eager, on the CPU) as ONE C call, where the model runs its forwards as C programs
    (`CausalLM.round_program`) -> (the tokens [B][K+2] `verify` returns, seconds in the draft chain, seconds in the
    call: what the round costs the machine, the host's time around it left out), or None where it
    cannot (the round then runs its steps, to the same result: tests/test_round_kernel.py). `limits` [B]: the drafts
    each row may use; rows [0, decoding) decode, the rest keep nothing; `starts` [B]: the rows' positions on the host;
    `width`: the pending positions the draft's depth 1 reads; `vocab`: a reduced draft vocabulary's (head, ids).
    `sampling`: (RowSampling, draft noise [B, K, V], target noise [B, K+1, V], uniforms [B, K] or None; the noises None
    where every row is greedy) of a round of shaped rows (repetition penalty, temperature, top-k, top-p): the drafts'
    rule and accept.py's, in C (step.c `pick`, `unseeded_row`), the penalty over the state's `seen` and the drafts
    before each position; None: greedy rows with no shaping."""
    B = st.pos.shape[0]
    plan = _bound(model, st, K, K == 0 and decoding == B, vocab)
    if plan is None:
        return None
    prog, call = plan.program, plan.call
    T = K + 1
    if max(starts) + T > prog.slots:
        raise ValueError(f"attend: positions up to {max(starts) + T - 1} past the cache's {prog.slots}")
    for b in range(B):
        plan.limit[b], plan.active[b], prog.starts[b] = limits[b], b < decoding, starts[b]
    if K:
        if not 1 <= width <= st.pend_h.shape[1]:
            return None
        prog.draft_args.W = width
    if sampling is not None:
        rs, d_noise, t_noise, u = sampling
        if (rs.use_penalty and st.seen is None) or (rs.any_sampled and t_noise is None):
            return None
        q = unseeded = None
        if K and rs.any_unseeded:  # the unseeded rule reads the drafts' q (a buffer the state keeps, [B, K, V])
            q = st.__dict__.get("sample_q")
            if q is None or q.shape != (B, K, t_noise.shape[-1]):
                q = st.__dict__["sample_q"] = torch.empty(B, K, t_noise.shape[-1])
            unseeded = (rs.unseeded, u)
        penalty = (rs.penalty, st.seen) if rs.use_penalty else (None, None)
        drafts = PickRule(rs.temperature, rs.greedy, rs.top_k, d_noise, q, *penalty)
        target = PickRule(rs.temperature, rs.greedy, rs.top_k, t_noise, None, *penalty, rs.top_p if rs.use_top_p else None)
        if not prog.sample(drafts, target, unseeded, ctypes.addressof(plan.limit)):
            return None
        call.pick = ctypes.addressof(prog.pick)
    elif call.pick is not None:  # (a greedy round after sampled ones: the programs back on the argmax)
        prog.sample(None, None)
        call.pick = None
    call.nth = torch.get_num_threads()
    status = LIBRARY.lib().greedy_round(ctypes.byref(call))
    if status:
        _raise(status, call.stage, prog)
    out = plan.out[:]
    return [out[b * (K + 2):(b + 1) * (K + 2)] for b in range(B)], call.draft_ns * 1e-9, call.round_ns * 1e-9


def greedy_rounds(model, st, ks: tuple[int, int], full: bool, left: int, start: int, vocab=None, stop: list[int] = (),
                  rounds: int = 16) -> tuple[list[tuple[int, list[int]]], list[float], float] | None:
    """Up to `rounds` greedy rounds of one row (B = 1, greedy with no shaping) as ONE C call (round.c `greedy_rounds`):
    each the round `greedy_round` would run, the host's work between them (the row's position, the draft chain's
    width) done in C. `ks`: the drafts of a round after a rejection and after a fully accepted round (`auto`'s k by
    state; a fixed k twice), `full`: the state the first round starts in -> (each round's (K, tokens [K+2])), each
    round's seconds, seconds in the draft chains in all), at least one round; None where it cannot (the caller runs
    `greedy_round`). It stops after a round that emitted a `stop` token, when fewer than K + 1 tokens are `left` for
    the next round, or after `rounds`. `start`: the row's position on the host; `vocab`: as `greedy_round`'s. What it
    saves is the host's time between rounds (~0.12 ms a round on the shipped model, docs/decisions.md)."""
    K0 = ks[full]
    if st.pos.shape[0] != 1 or left < K0 + 1 or (0 in ks and ks[0] != ks[1]):  # (a round with no drafts keeps its state)
        return None
    plans = [_bound(model, st, K, K == 0, vocab) for K in ks]
    if None in plans or start + K0 + 1 > plans[0].program.slots:
        return None
    for plan, K in zip(plans, ks):
        prog, call = plan.program, plan.call
        if call.pick is not None:  # (a greedy round after sampled ones: the programs back on the argmax)
            prog.sample(None, None)
            call.pick = None
        plan.limit[0], plan.active[0] = K, True
        call.nth = torch.get_num_threads()
    KM = max(ks)
    first = plans[full]
    if first.outs is None or len(first.outs) < rounds * (KM + 4):
        first.outs = (ctypes.c_int64 * (rounds * (KM + 4)))()
    outs = first.outs  # each round's K, tokens and n [rounds][KM+3], then their nanoseconds [rounds]
    times = ctypes.addressof(outs) + 8 * rounds * (KM + 3)
    ptrs = lambda xs: (ctypes.c_void_p * 2)(*xs)  # noqa: E731
    calls = ptrs([ctypes.addressof(p.call) for p in plans])
    starts = ptrs([ctypes.addressof(p.program.starts) for p in plans])
    widths = ptrs([0 if p.program.draft_args is None else
                   ctypes.addressof(p.program.draft_args) + type(p.program.draft_args).W.offset for p in plans])
    stops = (ctypes.c_int64 * max(1, len(stop)))(*stop)
    done, draft_ns = ctypes.c_int64(), ctypes.c_int64()
    status = LIBRARY.lib().greedy_rounds(calls, int(full), rounds, ctypes.addressof(stops), len(stop), left, start,
                                         first.program.slots, starts, widths, ctypes.addressof(outs), times,
                                         ctypes.byref(done), ctypes.byref(draft_ns))
    if status:
        failed = plans[0] if plans[0].call.stage else plans[1]  # (the plan whose round failed keeps its stage)
        _raise(status, failed.call.stage, failed.program)
    n, S = done.value, KM + 3
    recs = [outs[i * S: i * S + S] for i in range(n)]
    seconds = [t * 1e-9 for t in outs[rounds * S: rounds * S + n]]
    return [(r[0], r[1:r[0] + 3]) for r in recs], seconds, draft_ns.value * 1e-9


def _raise(status: int, stage: int, prog) -> None:
    if stage == 1:
        if status == -2:
            raise IndexError(f"a pending token id is outside the vocabulary of {prog.draft_args.V}")
        if status in (-3, -4):
            raise ValueError("draft: an MTP position or pending count out of range")
    elif stage == 2:
        if status == -2:
            raise IndexError(f"a token id is outside the vocabulary of {prog.verify_prog.vocab}")
        if status == -3:
            raise IndexError(f"a position is outside the cache's {prog.slots} slots")
        if status == -5:
            raise IndexError(f"a position is outside the rotary table's {prog.table[0].shape[0]} rows")
    raise MemoryError(f"greedy_round: out of memory (stage {stage})")
