"""Summaries of the measured runs: per prompt kind and configuration, as Markdown, JSON and PNG plots."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from .costmodel import cost_model_speedup
from .measure import HF, PLAIN, BenchConfig, Run
from .prompts import Prompt

ACCEPTED_LENGTH_NOTE = "mean accepted length = tokens emitted per backbone forward, the bonus/correction token included"


def summarize(runs: list[Run], prompts: list[Prompt], configs: list[BenchConfig], costs: dict | None = None) -> dict:
    """{kind: {config: figures}} for kind in code / text / all (kinds with no prompt left out).

    tokens/s = sum of new tokens / sum over prompts of the median (over repeats) wall time.
    paired speedup = median over (prompt, repeat) of t(plain) / t(config) from the same interleaved round.
    """
    kinds = [k for k in ("code", "text") if any(p.kind == k for p in prompts)]
    out: dict[str, dict] = {}
    for kind in kinds + (["all"] if len(kinds) > 1 else []):
        sel = {i for i, p in enumerate(prompts) if kind == "all" or p.kind == kind}
        out[kind] = _summarize_kind([r for r in runs if r.prompt in sel], configs, costs)
    return out


def _summarize_kind(runs: list[Run], configs: list[BenchConfig], costs: dict | None) -> dict:
    by_cfg: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_cfg[r.config].append(r)
    secs = {(r.config, r.prompt, r.repeat): r.seconds for r in runs}
    res: dict[str, dict] = {}
    for cfg in configs:
        rs = by_cfg.get(cfg.name)
        if not rs:
            continue
        per_prompt: dict[int, list[Run]] = defaultdict(list)
        for r in rs:
            per_prompt[r.prompt].append(r)
        tokens = sum(len(v[0].tokens) for v in per_prompt.values())
        seconds = sum(statistics.median(x.seconds for x in v) for v in per_prompt.values())
        paired = [secs[(PLAIN, r.prompt, r.repeat)] / r.seconds for r in rs if (PLAIN, r.prompt, r.repeat) in secs]
        fig = {"engine": cfg.engine, "draft_tokens": cfg.draft_tokens, "variant": cfg.variant.name, "runs": len(rs),
               "new_tokens": tokens,
               "median_seconds": round(seconds, 4), "tokens_per_s": tokens / seconds if seconds else 0.0,
               "paired_speedup_vs_plain": statistics.median(paired) if paired else None,
               "peak_rss_mb": round(max(r.peak_rss_mb for r in rs), 1)}
        extra = [r.peak_rss_mb - r.rss_before_mb for r in rs if r.rss_before_mb is not None]
        if extra:
            fig["peak_extra_mb"] = round(max(extra), 1)  # over the resident set before the run: its working memory
        stats = [r.stats for r in rs if r.stats]
        if stats:
            forwards = sum(s["backbone_forwards"] for s in stats)
            fig["mean_accepted_length"] = sum(s["new_tokens"] - 1 for s in stats) / forwards if forwards else 0.0
            drafted = _sum_lists([s["drafted_per_position"] for s in stats])
            accepted = _sum_lists([s["accepted_per_position"] for s in stats])
            fig["acceptance_per_position"] = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
            fig["drafted_per_position"], fig["accepted_per_position"] = drafted, accepted
            parts = {p: sum(s["time_s"][p] for s in stats) for p in ("prefill", "draft", "verify", "other")}
            total = sum(parts.values()) or 1.0
            fig["time_split"] = {p: v / total for p, v in parts.items()}
            ks = [k for r in rs for k in r.k_history]
            if ks:
                fig["mean_k"] = sum(ks) / len(ks)
            if costs and isinstance(cfg.draft_tokens, int) and "c_draft" in costs:
                cv = {int(q): v for q, v in costs["c_verify"].items()}
                fig["cost_model_speedup"] = cost_model_speedup(fig["acceptance_per_position"], cfg.draft_tokens, costs["c_draft"], cv)
        res[cfg.name] = fig
    base = res.get(PLAIN, {}).get("tokens_per_s")
    hf = res.get(HF, {}).get("tokens_per_s")
    for fig in res.values():
        fig["speedup_vs_plain"] = fig["tokens_per_s"] / base if base else None
        fig["speedup_vs_transformers"] = fig["tokens_per_s"] / hf if hf else None
    return res


def _sum_lists(lists: list[list[int]]) -> list[int]:
    n = max((len(x) for x in lists), default=0)
    return [sum(x[j] for x in lists if j < len(x)) for j in range(n)]


def _x(v: float | None, fmt: str = "{:.2f}x") -> str:
    return "–" if v is None else fmt.format(v)


def markdown_table(summary: dict, kind: str) -> str:
    """One Markdown table for a prompt kind."""
    head = ("| configuration | tokens/s | vs mtp plain | vs transformers | accepted length* | acceptance by position "
            "| time draft / verify / other / prefill | peak RSS MiB (+ run) | cost-model speedup |")
    lines = [head, "|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for name, f in summary[kind].items():
        split = f.get("time_split")
        split_s = " / ".join(f"{100 * split[p]:.0f}%" for p in ("draft", "verify", "other", "prefill")) if split else "–"
        acc = f.get("acceptance_per_position")
        acc_s = " ".join(f"{a:.2f}" for a in acc) if acc else "–"
        mal = f.get("mean_accepted_length")
        label = name + (f" (mean k {f['mean_k']:.1f})" if f.get("draft_tokens") == "auto" and "mean_k" in f else "")
        lines.append(f"| {label} | {f['tokens_per_s']:.1f} | {_x(f['speedup_vs_plain'])} | {_x(f['speedup_vs_transformers'])} "
                     f"| {_x(mal, '{:.2f}')} | {acc_s} | {split_s} | {f['peak_rss_mb']:.0f} (+{f.get('peak_extra_mb', 0):.1f}) "
                     f"| {_x(f.get('cost_model_speedup'))} |")
    return "\n".join(lines)


def best_fixed_k(figures: dict) -> tuple[str, dict] | None:
    """The fixed-k configuration with the highest tokens/s, and how auto compares to it."""
    figures = {n: f for n, f in figures.items() if not f.get("variant")}  # the default variant's k against its auto
    fixed = [(n, f) for n, f in figures.items() if isinstance(f.get("draft_tokens"), int)]
    if not fixed:
        return None
    name, best = max(fixed, key=lambda nf: nf[1]["tokens_per_s"])
    out = {"config": name, "tokens_per_s": best["tokens_per_s"], "speedup_vs_plain": best.get("speedup_vs_plain")}
    auto = next((f for f in figures.values() if f.get("draft_tokens") == "auto"), None)
    if auto:
        out["auto_relative_to_best"] = auto["tokens_per_s"] / best["tokens_per_s"]
    return name, out


def markdown_report(summary: dict, meta: dict) -> str:
    parts = []
    for kind in summary:
        n = meta["prompt_counts"].get(kind, sum(meta["prompt_counts"].values()))
        text = (f"#### {kind} prompts ({n}), {meta['max_new_tokens']} new tokens, {meta['repeats']} repeats, "
                f"{meta['threads']} thread(s)\n\n" + markdown_table(summary, kind))
        best = best_fixed_k(summary[kind])
        if best:
            b = best[1]
            text += f"\n\nbest fixed k: {best[0]} ({_x(b['speedup_vs_plain'])} mtp plain)"
            if "auto_relative_to_best" in b:
                text += f"; auto reaches {100 * b['auto_relative_to_best']:.1f}% of its tokens/s"
        parts.append(text)
    parts.append(f"\\* {ACCEPTED_LENGTH_NOTE}. Speedups are ratios of tokens/s (medians over interleaved repeats). "
                 "The cost-model speedup is E(k) / (k c_draft + c_verify(k+1)) from the measured acceptance.")
    for name, why in meta.get("notes", {}).items():
        parts.append(f"note: {name}: {why}")
    return "\n\n".join(parts)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot(summary: dict, out: Path) -> list[Path]:
    """acceptance_by_position.png and speedup_vs_k.png (matplotlib Agg); [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    kinds = [k for k in summary if k != "all"] or list(summary)
    styles = {"code": "-", "text": "--", "all": ":"}

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    names = [n for n, f in summary[kinds[0]].items() if f.get("acceptance_per_position")]
    colors = {n: f"C{i}" for i, n in enumerate(names)}  # one colour per configuration, one line style per kind
    longest = 1
    for kind in kinds:
        for name, f in summary[kind].items():
            acc = f.get("acceptance_per_position")
            if acc:
                longest = max(longest, len(acc))
                ax.plot(range(1, len(acc) + 1), acc, styles.get(kind, "-"), marker="o", color=colors.get(name),
                        label=f"{name} ({kind})")
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("draft position j")
    ax.set_ylabel("P(draft j accepted | drafts before accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("MTP acceptance by draft position")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "acceptance_by_position.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for kind in kinds:
        pts = [(f["draft_tokens"], f) for f in summary[kind].values()
               if isinstance(f.get("draft_tokens"), int) and not f.get("variant")]
        pts.sort(key=lambda t: t[0])
        ks = [k for k, _ in pts]
        if ks:
            line = ax.plot(ks, [f["speedup_vs_plain"] for _, f in pts], styles.get(kind, "-"), marker="o",
                           label=f"measured ({kind})")[0]
            points = [(k, f["cost_model_speedup"]) for k, f in pts if f.get("cost_model_speedup") is not None]
            if points:
                ax.plot([k for k, _ in points], [b for _, b in points], ":", marker="x", color=line.get_color(),
                        label=f"cost-model speedup ({kind})")
            auto = next((f for f in summary[kind].values() if f.get("draft_tokens") == "auto" and not f.get("variant")), None)
            if auto:
                ax.scatter([max(ks) + 1], [auto["speedup_vs_plain"]], marker="*", s=120, color=line.get_color(),
                           label=f"auto ({kind})")
        hf = summary[kind].get(HF)
        if hf and hf.get("speedup_vs_plain"):
            ax.axhline(hf["speedup_vs_plain"], color="grey", linestyle=styles.get(kind, "-"), linewidth=1,
                       label=f"transformers generate ({kind})")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ks = sorted({f["draft_tokens"] for kind in kinds for f in summary[kind].values() if isinstance(f.get("draft_tokens"), int)})
    if ks:
        has_auto = any(f.get("draft_tokens") == "auto" for kind in kinds for f in summary[kind].values())
        ax.set_xticks(ks + ([max(ks) + 1] if has_auto else []), [str(k) for k in ks] + (["auto"] if has_auto else []))
    ax.set_xlabel("draft tokens k")
    ax.set_ylabel("tokens/s relative to mtp plain greedy")
    ax.set_title("Speculative decoding speedup vs k")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    paths.append(_save(fig, out / "speedup_vs_k.png"))
    return paths
