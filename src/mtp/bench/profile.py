"""Where one decode round's time goes: wall time, dispatched operations and time in the linear kernels per round.

One greedy generation per configuration, measured twice after a warm-up (which also compiles a compiled variant's
graphs): once plain for the wall time, once under `torch.profiler` for the counts (the profiler adds a few
microseconds per operation, so its run is not timed). Per round (one backbone forward):
- `ops`: operations the host dispatches (aten and `mtp::` calls not nested in another operation; a compiled graph's
  own fused loops are not operations, the prepared linear kernels it calls are);
- `graph_calls`: compiled graph replays (0 eager);
- `linear_ms`: time inside the linear layers' kernels (the weights' bytes and FLOPs; at the shipped model's size
  this is the part the hardware must spend);
- `other_ms` = wall - linear: everything else (attention, norms, activations, the Python round, dispatch): an
  upper bound on the host overhead, which is the part compiling removes;
- `c_calls`, `c_ms`: calls into our C kernels (model/native.py, which the profiler does not see: the one-call
  forward and draft, the qmatmul products, ...) and the time inside them, each round of a third run timed under
  `native.timed()`; that run is longer (STEADY_TOKENS), so its figures are a steady round's: a generation's first
  rounds also bind its C programs (~0.3 ms a round shape, once per generation), which over 16 tokens added
  0.15-0.2 ms to every round (code-small, k = 3: 0.29-0.37 ms against 0.12-0.13; docs/decisions.md, 2026-12-06,
  fourth session);
- `host_ms` = that run's round time - c_ms - linear_ms: the Python round, tensor operations and dispatch.
"""

from __future__ import annotations

import time

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from ..decode import generate
from ..decode.decoder import Decoder
from ..model import native

STEADY_TOKENS = 128  # the timed run's new tokens (fewer where the context has no room)

# the kernels of the linear layers (model/linear.py: FastLinear's prepared kernels and the plain ones)
LINEAR_KERNELS = ("mtp::prepared_linear", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm", "aten::addmm",
                  "aten::mm", "aten::bmm", "aten::linear", "aten::matmul")
OPS = ("aten::", "mtp::", "mkldnn::", "quantized::")  # what the host dispatches
GRAPH_CALL = ("Torch-Compiled Region", "CompiledFxGraph")
ROUND = "decode round"  # the profiler range each round runs in while profiled (not an operation: no `mtp::`)


def _in_round(e) -> bool:
    parent = e.cpu_parent
    while parent is not None and parent.name != ROUND:
        parent = parent.cpu_parent
    return parent is not None


def _outermost(events, names: tuple[str, ...]) -> list:
    """Events inside a decode round whose name starts with one of `names` and that are not nested in another such
    event. Counting inside the rounds (rather than subtracting a prompt-only run) keeps the prefill out exactly: a
    difference of two timed runs is noise where a round's share is small."""
    out = []
    for e in events:
        if e.device_type != DeviceType.CPU or not e.name.startswith(names):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(names):
            parent = parent.cpu_parent
        if parent is None and _in_round(e):
            out.append(e)
    return out


def _profiled_rounds(model, ids: list[int], kw: dict) -> tuple[list, int]:
    """One generation under torch's profiler, each round in a `ROUND` range -> (events, rounds)."""
    real = Decoder._round

    def named_round(self, D, cold=False):
        with record_function(ROUND):
            return real(self, D, cold)

    Decoder._round = named_round
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            r = generate(model, ids, **kw)
    finally:
        Decoder._round = real
    return prof.events(), max(1, r.stats.backbone_forwards)


def _rounds_in_c(model, ids: list[int], kw: dict, linear_ms: float) -> tuple[float, float, float]:
    """One more generation, each round timed whole and for the time inside our C kernels (ctypes calls, which the
    profiler does not see) -> per round (C ms, C calls, host ms = round - C - linear_ms). (A `_round` call may run
    several rounds in one C call, `Decoder.chain`: the figures are per round the generation counted.)"""
    rounds = []  # (wall seconds, C seconds, C calls) per `_round` call
    real = Decoder._round

    def timed_round(self, D, cold=False):
        with native.timed() as c:
            t0 = time.perf_counter()
            out = real(self, D, cold)
            rounds.append((time.perf_counter() - t0, c.seconds, c.calls))
        return out

    Decoder._round = timed_round
    try:
        room = model.context_length - len(ids) - 1
        r = generate(model, ids, **{**kw, "max_new_tokens": max(kw["max_new_tokens"], min(STEADY_TOKENS, room))})
    finally:
        Decoder._round = real
    n = max(1, r.stats.backbone_forwards)
    wall, c_s, calls = (sum(r[i] for r in rounds) for i in range(3))
    return c_s / n * 1e3, calls / n, max(0.0, (wall - c_s) / n * 1e3 - linear_ms)


def round_profile(model, ids: list[int], draft_tokens: int | str | None, compiled: bool, max_new_tokens: int = 16) -> dict:
    """Profile one greedy generation of `max_new_tokens` from `ids`; returns per-round figures (see the module
    docstring) and `rounds`, `tokens_per_round`. Keep `max_new_tokens` small: torch's profiler takes seconds per
    thousand operations to assemble its events (an eager round is ~1,000-2,000 of them)."""
    kw = dict(max_new_tokens=max_new_tokens, temperature=0.0, draft_tokens=draft_tokens, eos_token_ids=[],
              compile=compiled)
    generate(model, ids, **kw)  # warm-up (and compilation)
    t0 = time.perf_counter()
    r = generate(model, ids, **kw)
    wall = time.perf_counter() - t0
    decode_s = r.stats.time_total - r.stats.time_prefill
    rounds = max(1, r.stats.backbone_forwards)
    events, prounds = _profiled_rounds(model, ids, kw)
    ops = len(_outermost(events, OPS))
    graphs = sum(1 for e in events if e.name.startswith(GRAPH_CALL) and _in_round(e))
    linear_us = sum(e.cpu_time_total for e in _outermost(events, LINEAR_KERNELS))
    ms_round = decode_s / rounds * 1e3
    linear_ms = linear_us / prounds / 1e3
    c_ms, c_calls, host_ms = _rounds_in_c(model, ids, kw, linear_ms)
    return {"rounds": rounds, "tokens_per_round": round((r.stats.new_tokens - 1) / rounds, 3),
            "wall_s": round(wall, 4), "ms_per_round": round(ms_round, 3), "ops_per_round": round(ops / prounds, 1),
            "graph_calls_per_round": round(graphs / prounds, 2), "linear_ms_per_round": round(linear_ms, 3),
            "other_ms_per_round": round(max(0.0, ms_round - linear_ms), 3), "c_ms_per_round": round(c_ms, 3),
            "c_calls_per_round": round(c_calls, 1), "host_ms_per_round": round(host_ms, 3)}


def format_profile(rows: dict[str, dict]) -> str:
    """A markdown table of {configuration: round_profile(...)}."""
    lines = ["| configuration | ms / round | tokens / round | ops / round | graph calls / round | linear kernels ms | "
             "C calls / round | C kernels ms | host ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in rows.items():
        lines.append(f"| {name} | {p['ms_per_round']:.2f} | {p['tokens_per_round']:.2f} | {p['ops_per_round']:.0f} | "
                     f"{p['graph_calls_per_round']:.1f} | {p['linear_ms_per_round']:.2f} | {p['c_calls_per_round']:.1f} | "
                     f"{p['c_ms_per_round']:.2f} | {p['host_ms_per_round']:.2f} |")
    return "\n".join(lines)
