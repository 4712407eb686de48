"""The end of a greedy round as one C call (`round.c`): round.py's `verify` hands it the verify's argmax when every
row is greedy with no logit shaping and nothing rides along, on the CPU, eagerly. It leaves the round state exactly as
the tensor form below it in round.py does (tests/test_round_kernel.py), in one call instead of ~35 tensor operations
of a few values each (~0.3 ms a round on the shipped model, docs/decisions.md). Built and loaded as model/native.py
describes; MTP_NATIVE=0 (or no compiler) keeps the tensor form.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..model.native import NativeLibrary

p, i64 = ctypes.c_void_p, ctypes.c_int64


class _Round(ctypes.Structure):
    _fields_ = ([(n, i64) for n in ("B", "K", "PR", "hbytes")]
                + [(n, p) for n in ("target", "drafts", "limit", "active", "hidden", "pos", "last", "mtp_pos",
                                    "pend_next", "pend_n", "pend_h", "keep", "out")])


def _declare(lib: ctypes.CDLL) -> None:
    lib.accept_greedy.argtypes = [ctypes.POINTER(_Round)]
    lib.accept_greedy.restype = None


LIBRARY = NativeLibrary(Path(__file__).with_name("round.c"), None, "the round's accept runs as tensor operations",
                        _declare)


def usable(st, drafts: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Can `accept_greedy` run on round state `st` (`RoundState`) with drafts [B, K] and the verify's hidden states
    [B, K+1, H] here (CPU tensors, eager, no repetition penalty)?"""
    B, K = drafts.shape
    ints = [drafts, st.pos, st.last] + ([st.mtp_pos, st.pend_next, st.pend_n] if st.mtp_cache is not None else [])
    return (not torch.compiler.is_compiling() and st.seen is None and LIBRARY.available()
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
    mtp = st.mtp_cache is not None
    target, limit, active = (t.to(dt).contiguous() for t, dt in ((target, torch.int64), (limit, torch.int64),
                                                                   (active, torch.bool)))
    if target.shape != (B, K + 1) or limit.shape != (B,) or active.shape != (B,):
        raise ValueError(f"accept_greedy: target {list(target.shape)}, limit {list(limit.shape)}, active "
                         f"{list(active.shape)} for {B} rows of {K} drafts")
    out = torch.empty(B, K + 2, dtype=torch.int64)
    keep = torch.empty(B, dtype=torch.int64)
    r = _Round(B, K, st.pend_h.shape[1] if mtp else 0, hidden.shape[-1] * hidden.element_size(), target.data_ptr(),
               drafts.data_ptr(), limit.data_ptr(), active.data_ptr(), hidden.data_ptr(), st.pos.data_ptr(),
               st.last.data_ptr(), *((st.mtp_pos.data_ptr(), st.pend_next.data_ptr(), st.pend_n.data_ptr(),
                                      st.pend_h.data_ptr()) if mtp else (None,) * 4), keep.data_ptr(), out.data_ptr())
    LIBRARY.lib().accept_greedy(ctypes.byref(r))
    return out, keep
