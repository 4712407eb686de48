"""Cost model of MTP speculative decoding: what the measured acceptance allows on this machine.

With per-position acceptance a_1..a_k (a_j = P(draft j accepted | drafts before it accepted)), one step
emits on average E(k) = sum_{j=0..k} prod_{i<=j} a_i tokens (j = 0: the verified/bonus token, always 1),
and costs k draft steps plus one verify forward of k+1 tokens. In units of one plain decode step t(1):

    cost-model speedup(k) = E(k) / (k * c_draft + c_verify(k + 1)),   c_verify(q) = t(verify q) / t(1),
                                                                 c_draft = t(one MTP draft step) / t(1).

It is an estimate, not a strict bound: it leaves out the per-step bookkeeping (acceptance, rollback,
the MTP catching up on accepted tokens over several positions), which pulls the measured speedup below
it, and it prices every step at the cost model's context length, while plain decoding also pays for
its growing context.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ..model import config_from_dict
from ..model.families import model_class_for

# Qwen3.5-0.8B's text shape (hidden 1024, 24 layers, real 248,320-token vocabulary, one MTP layer).
SHAPES = {
    "qwen3.5-0.8b": dict(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=4, tie_word_embeddings=True,
        mtp_num_hidden_layers=1, max_position_embeddings=4096, model_type="qwen3_5_text",
    ),
    # Qwen3.5-35B-A3B's real widths and expert counts (256 experts, top-8, expert width 512, a shared expert of
    # 512) and its MoE MTP layer, on a 4-layer slice (3 Gated DeltaNet + 1 attention, the real 3:1 pattern).
    "qwen3.5-35b-a3b": dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, full_attention_interval=4, tie_word_embeddings=False, mtp_num_hidden_layers=1,
        max_position_embeddings=4096, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, model_type="qwen3_5_moe_text",
    ),
    # DeepSeek-V3's real widths (MLA with q-LoRA 1536 / kv-LoRA 512, 128 heads, YaRN x40, expert width 2048, top-8 in
    # 4 of 8 groups, one shared expert, 129,280-token vocabulary) on a slice: 1 dense + 1 MoE layer and the MoE MTP
    # layer. To fit ~10 GB in bf16 (8.8 GB) the slice has 16 routed experts instead of 256 (a token still reads 8 of
    # them, but a verify of q tokens reads at most 16: verify costs come out low for q >= 3), and its MTP layer uses
    # the backbone's embedding and head (GLM-4.6 style) instead of its own copies (the draft costs the same).
    "deepseek-v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=8,
        n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        num_nextn_predict_layers=1, mtp_embed_tokens=False, mtp_shared_head=False, tie_word_embeddings=False,
        max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 4096},
        model_type="deepseek_v3",
    ),
    # GLM-4.5's real widths (96 heads of 128 with 8 KV heads, q/k norm, RoPE on half of each head, expert width 1536,
    # top-8, one shared expert, 151,552-token vocabulary) on a slice: 1 dense + 1 MoE layer and the MoE MTP layer, with
    # 32 routed experts instead of 160 and the MTP layer on the backbone's embedding and head (7.5 GB in bf16).
    "glm-4.5": dict(
        vocab_size=151552, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=96, num_key_value_heads=8, head_dim=128, use_qk_norm=True,
        attention_bias=True, partial_rotary_factor=0.5, rope_theta=1000000.0, rms_norm_eps=1e-5, n_routed_experts=32,
        num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=1, mtp_embed_tokens=False, mtp_shared_head=False,
        tie_word_embeddings=False, max_position_embeddings=131072, model_type="glm4_moe",
    ),
}
# Layers of the real model a shape is a slice of: its costs are also extrapolated to that depth.
FULL_LAYERS = {"qwen3.5-35b-a3b": 40, "deepseek-v3": 61, "glm-4.5": 92}


def expected_tokens(acceptance: list[float], k: int) -> float:
    """E(k) = 1 + a1 + a1 a2 + ... + a1..ak: tokens emitted per verify step (bonus included)."""
    total, run = 1.0, 1.0
    for j in range(k):
        run *= acceptance[j] if j < len(acceptance) else 0.0
        total += run
    return total


def cost_model_speedup(acceptance: list[float], k: int, c_draft: float, c_verify: dict[int, float]) -> float | None:
    """E(k) / (k c_draft + c_verify(k+1)); None when c_verify(k+1) was not measured."""
    cv = c_verify.get(k + 1)
    if cv is None:
        return None
    return expected_tokens(acceptance, k) / (k * c_draft + cv)


def build_shape_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random-weight model of a named shape, built in code (no download)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    config = config_from_dict(dict(SHAPES[name]))
    with torch.device("meta"):  # skip the default init (slow at 0.8B), then materialise once, in the target dtype
        model = model_class_for(config)(config).to(dtype)
    model = model.to_empty(device="cpu")
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    torch.manual_seed(seed)
    model.init_weights()
    return model.to(dtype).eval()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _step_fns(model, q_max: int, context: int, extra_heads: dict | None) -> dict:
    """The timed operations, all starting at the same cache position `context`: the plain step, verify of
    q = 1..q_max (what rollback needs kept), the same q through the prefill path, and the MTP draft step."""
    dev = model.device
    c = model.config
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, c.vocab_size, (1, context), generator=g).to(dev)
    cache = model.new_cache(1, context + q_max + 4)
    hidden = model.hidden(prompt, cache)[:, -1:]  # [1, 1, H]
    p0 = cache.pos
    model.prepare_decode(context + q_max + 4)
    toks = {q: torch.randint(0, c.vocab_size, (1, q), generator=g).to(dev) for q in range(1, q_max + 1)}
    at = {q: model.decode_positions(torch.arange(p0, p0 + q, device=dev)[None], [p0]) for q in range(1, q_max + 1)}
    keep = torch.tensor([1], device=dev)

    def decode(q: int):  # a decode forward of q tokens (q = 1: a plain step), its argmax, and keeping one position
        def f():
            h, steps = model.decode(toks[q], cache, at[q])
            model.head(h).argmax(-1).tolist()
            cache.keep_at(steps, keep)
        return f

    plain = decode(1)
    verify = decode

    def prefill_path(q: int):
        def f():
            cache.pos = p0
            model(toks[q], cache).argmax(-1).tolist()
        return f

    def head(q: int):
        h = hidden.expand(1, q, hidden.shape[-1]).contiguous()
        return lambda: model.head(h).argmax(-1).tolist()

    fns = {"plain": plain}
    fns.update({f"verify{q}": verify(q) for q in range(1, q_max + 1)})
    fns.update({f"head{q}": head(q) for q in range(1, q_max + 1)})
    fns.update({f"chunked{q}": prefill_path(q) for q in (2, 4, 8) if q <= q_max})
    if model.mtp is not None:
        mcache = model.new_mtp_cache(1, context + q_max + 4)

        def mtp_layer():  # one chained draft step, as the round runs it
            return model.mtp_step(1, hidden, toks[1], at[1], mcache)

        h_mtp = mtp_layer()
        fns["draft"] = lambda: int(model.draft_head(mtp_layer(), 1)[0, -1].argmax())
        fns["draft_layer"] = mtp_layer
        fns["draft_head"] = lambda: int(model.draft_head(h_mtp, 1)[0, -1].argmax())
        for name, head in (extra_heads or {}).items():
            fns[f"draft_head[{name}]"] = lambda head=head: int(head(h_mtp))
            fns[f"draft[{name}]"] = lambda head=head: int(head(mtp_layer()))
    return fns


def _time_interleaved(fns: dict, iters: int, warmup: int) -> dict[str, float]:
    """Median wall time of each function, all of them run in turn every iteration (noise hits them alike)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for it in range(warmup + iters):
        for name, fn in fns.items():
            t = _timed(fn)
            if it >= warmup:
                times[name].append(t)
    return {k: statistics.median(v) for k, v in times.items() if v}


def plain_step_seconds(models: dict, iters: int, warmup: int = 1, context: int = 128) -> dict[str, float]:
    """{name: model} -> {name: median seconds of its plain decode step at position `context`}, the models timed in
    turn every iteration (A B C A B C ...) so the machine's noise hits them alike."""
    with torch.inference_mode():  # (the prompt's read too: a quantized model may hold only its codes)
        fns = {name: _step_fns(m, 1, context, None)["plain"] for name, m in models.items()}
        return _time_interleaved(fns, iters, warmup)


def _time_by_threads(plain, iters: int, warmup: int) -> dict[int, float]:
    """The plain step at 1 and 2 threads (those this machine has), alternating A B A B."""
    threads = torch.get_num_threads()
    counts = [threads] + [n for n in (1, 2) if n != threads and n <= (os.cpu_count() or 1)]
    if len(counts) == 1:
        return {}
    by_threads: dict[int, list[float]] = {n: [] for n in counts}
    for it in range(warmup + iters):
        for n in counts:
            torch.set_num_threads(n)
            try:
                plain()  # the first step after a change of thread count pays for waking the pool
                t = _timed(plain)
            finally:
                torch.set_num_threads(threads)
            if it >= warmup:
                by_threads[n].append(t)
    return {n: statistics.median(v) for n, v in by_threads.items()}


@torch.inference_mode()
def measure_costs(model, q_max: int = 8, context: int = 128, iters: int = 15, warmup: int = 2,
                  extra_heads: dict | None = None, compare_threads: bool = True) -> dict:
    """Median wall times of: one plain decode step t(1); a verify forward of q = 1..q_max tokens (with
    what the DeltaNet rollback needs kept, as speculative decoding does) and the same q tokens through the prefill
    path (q = 2, 4, 8); one MTP draft step (MTP layer + head + argmax) and its parts.

    `extra_heads`: {name: fn(hidden [1,1,H]) -> token} alternative draft heads (e.g. a reduced vocabulary)
    timed beside the full head. `compare_threads`: also time the plain step at 1 and 2 threads. Returns times
    (s) and ratios to t(1)."""
    fns = _step_fns(model, q_max, context, extra_heads)
    med = _time_interleaved(fns, iters, warmup)
    t1 = med["plain"]
    out = {
        "context": context, "iters": iters, "threads": torch.get_num_threads(), "t1_s": t1,
        "plain_tokens_per_s": 1.0 / t1,
        "c_verify": {q: med[f"verify{q}"] / t1 for q in range(1, q_max + 1)},
        "c_chunked": {q: med[f"chunked{q}"] / t1 for q in (2, 4, 8) if q <= q_max},
        "c_head": {q: med[f"head{q}"] / t1 for q in range(1, q_max + 1)},
        "times_s": med,
        "t1_by_threads_s": _time_by_threads(fns["plain"], iters, warmup) if compare_threads else {},
    }
    if "draft" in med:
        out["c_draft"] = med["draft"] / t1
        out["c_draft_layer"] = med["draft_layer"] / t1
        out["c_draft_head"] = med["draft_head"] / t1
        for name in extra_heads or {}:
            out.setdefault("c_draft_reduced", {})[name] = med[f"draft[{name}]"] / t1
            out.setdefault("c_draft_head_reduced", {})[name] = med[f"draft_head[{name}]"] / t1
    return out


def extrapolate_depth(costs: dict, factor: float) -> dict:
    """Costs of a model `factor` times deeper than the measured slice: every forward's time outside the output head
    scales with depth, the head's does not; the one-layer MTP draft step is unchanged (in seconds)."""
    t = costs["times_s"]
    q_max = len(costs["c_verify"])
    body = {q: t[f"verify{q}"] - t[f"head{q}"] for q in range(1, q_max + 1)}
    full = {q: t[f"head{q}"] + factor * body[q] for q in body}
    t1 = t["head1"] + factor * (t["plain"] - t["head1"])
    out = {**costs, "t1_s": t1, "plain_tokens_per_s": 1.0 / t1, "c_verify": {q: v / t1 for q, v in full.items()},
           "c_chunked": {}, "c_head": {q: t[f"head{q}"] / t1 for q in body}, "t1_by_threads_s": {},
           "extrapolated_layers_factor": factor}
    for key in ("draft", "draft_layer", "draft_head"):
        if key in t:
            out[f"c_{key}"] = t[key] / t1
    for name in costs.get("c_draft_reduced", {}):
        out["c_draft_reduced"] = {**out.get("c_draft_reduced", {}), name: t[f"draft[{name}]"] / t1}
        out["c_draft_head_reduced"] = {**out.get("c_draft_head_reduced", {}), name: t[f"draft_head[{name}]"] / t1}
    return out


def speedup_table(acceptance: list[float], costs: dict, k_max: int | None = None) -> dict[int, float]:
    """{k: cost-model speedup} for k = 1..k_max (default: as many positions as were measured, up to q_max-1)."""
    c_verify = {int(q): v for q, v in costs["c_verify"].items()}
    k_max = k_max or min(max(len(acceptance), 1), max(c_verify) - 1)
    out = {}
    for k in range(1, k_max + 1):
        b = cost_model_speedup(acceptance, k, costs.get("c_draft", 0.0), c_verify)
        if b is not None:
            out[k] = b
    return out


def format_costs(costs: dict, title: str) -> str:
    """A small Markdown table of the measured cost ratios."""
    lines = [f"### {title}", "",
             f"t(1) = {costs['t1_s'] * 1e3:.2f} ms per plain decode step ({costs['plain_tokens_per_s']:.1f} tokens/s), "
             f"context {costs['context']}, {costs['threads']} thread(s), median of {costs['iters']}", "",
             "| q | " + " | ".join(str(q) for q in costs["c_verify"]) + " |",
             "|---|" + "---:|" * len(costs["c_verify"]),
             "| t(verify q)/t(1): verify forward, what rollback needs kept | "
             + " | ".join(f"{v:.2f}" for v in costs["c_verify"].values()) + " |",
             "| t(q)/t(1): same q tokens through the prefill path (chunks of 64) | " + " | ".join(
                 f"{costs['c_chunked'][q]:.2f}" if q in costs["c_chunked"] else "–" for q in costs["c_verify"]) + " |"]
    if costs.get("c_head"):
        lines.append("| t(head q)/t(1): the output head's part of it | " + " | ".join(
            f"{costs['c_head'][q]:.2f}" for q in costs["c_verify"]) + " |")
    by_threads = costs.get("t1_by_threads_s", {})
    if len(by_threads) > 1:
        lines += ["", "plain decode step by thread count: " + ", ".join(
            f"{n} thread(s) {t * 1e3:.2f} ms" for n, t in sorted(by_threads.items(), key=lambda kv: int(kv[0])))]
        t_by = {int(n): t for n, t in by_threads.items()}
        if 1 in t_by and 2 in t_by and t_by[2] > 1.5 * t_by[1]:
            lines.append("2 threads are much slower than 1: other jobs are using the cores (pass --threads 1, "
                         "or benchmark on a quiet machine)")
    if "c_draft" in costs:
        lines += ["", f"one MTP draft step: c_draft = {costs['c_draft']:.3f} x t(1) "
                      f"(MTP layer {costs['c_draft_layer']:.3f}, full-vocabulary head + argmax {costs['c_draft_head']:.3f})"]
        for name, v in costs.get("c_draft_reduced", {}).items():
            lines.append(f"with the {name} draft head: c_draft = {v:.3f} (head + argmax "
                         f"{costs['c_draft_head_reduced'][name]:.3f})")
    return "\n".join(lines)
