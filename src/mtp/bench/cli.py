"""`mtp bench` (the command): plain greedy vs MTP speculative decoding vs transformers (and transformers' own MTP
decoding, `generate(use_mtp=True)`, where the family has it), side by side in one run.

Everything runs on the same weights, prompts and thread count, interleaved (A B C … C B A …, several
repeats, medians). Greedy outputs must be identical in every configuration: the command fails loudly
otherwise. It writes `report.json`, `report.md` and two plots to `--out`, and prints the tables and the
cost model (what the measured acceptance allows on this machine, see `costmodel.py`).

`mtp bench --shape qwen3.5-0.8b` runs only the cost measurement, on a random-weight model of that
shape built in code: what the technique buys at real size on this machine.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path

import torch

from ..cli_common import (
    add_compile_arg,
    add_draft_args,
    add_model_args,
    auto_threads,
    draft_precision,
    load_from_args,
    model_name,
    parse_draft_tokens,
    resolve_quantize,
)
from ..decode import policy_store
from ..model import load_model, qmatmul
from .costmodel import (
    FULL_LAYERS,
    SHAPES,
    build_shape_model,
    extrapolate_depth,
    format_costs,
    measure_costs,
    plain_step_seconds,
    speedup_table,
)
from .measure import (
    HF,
    HF_MTP,
    Variant,
    check_identical,
    configs_for,
    load_transformers,
    plain_name,
    run_interleaved,
    transformers_mtp_note,
)
from .profile import format_profile, round_profile
from .prompts import DEFAULT_PROMPTS, Prompt, load_prompts
from .report import ACCEPTED_LENGTH_NOTE, best_fixed_k, markdown_report, plot, summarize

DEFAULT_OUT = Path("runs/bench")


def parse_draft_list(value: str) -> list[int | str]:
    """'1,2,3,4,auto' -> [1, 2, 3, 4, 'auto'] (plain decoding is always measured, so 0 is not a value here)."""
    out: list[int | str] = []
    for part in value.split(","):
        k = parse_draft_tokens(part.strip())
        if k is None:
            raise argparse.ArgumentTypeError("--draft-tokens values must be in 1..8 or 'auto' (plain is always measured)")
        out.append(k)
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="measure tokens/s: plain vs MTP speculative vs transformers",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompts", type=Path, default=None, help=f"prompt JSONL (kind/text); default: {DEFAULT_PROMPTS.name}")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per run (default 256; 24 with --quick)")
    p.add_argument("--draft-tokens", type=parse_draft_list, default=None,
                   help="comma list of k and 'auto' (default 1,2,3,4,auto; 1,3,auto with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats per prompt (default 3; 2 with --quick)")
    p.add_argument("--max-prompts", type=int, default=None, help="use at most this many prompts of each kind")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for report.json, report.md and plots")
    add_draft_args(p)
    p.add_argument("--variants", type=_variants, default=[],
                   help="more variants measured beside the default one, interleaved: comma list of fp32, bf16, fp16, int8, int4, "
                        "each optionally +vocabN or +vocab-full (the draft vocabulary; default: --draft-vocab's), "
                        "+compile, +draft-none|int8|int4 (the drafts' precision; default: --draft-quantize's), "
                        "e.g. bf16+draft-none,int8,int8+vocab4096; each is checked against its own plain decoding")
    p.add_argument("--quick", action="store_true", help="a CI-sized run: 1 prompt per kind, few tokens, 2 repeats")
    p.add_argument("--no-transformers", action="store_true", help="leave transformers' generate out")
    p.add_argument("--no-cost-model", action="store_true", help="skip the cost measurement")
    p.add_argument("--no-profile", action="store_true", help="skip the per-round profile (time and operations per round)")
    add_compile_arg(p)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="only measure the cost model on a random-weight model of this shape (no --model needed)")
    p.set_defaults(func=cmd_bench)


def _variants(spec: str) -> list[Variant]:
    """--variants' comma list -> Variants; a bad one is argparse's error with `Variant.parse`'s message."""
    try:
        return [Variant.parse(x) for x in spec.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "logical_cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            # which kernels int8/int4 layers run here (they differ in speed and in whether activations are quantized)
            "int8_int4_kernels": f"qmatmul (int8 activations, {qmatmul.isa()})" if qmatmul.available()
            else f"torch weight-only ({qmatmul.reason()})"}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def _costs_json(costs: dict) -> dict:
    return {k: ({str(q): v for q, v in val.items()} if isinstance(val, dict) else val) for k, val in costs.items()}


def cmd_shape(args) -> int:
    """Cost model alone on a random-weight model of a named shape."""
    from ..decode.draft_vocab import DraftVocab

    torch.set_num_threads(args.threads or auto_threads())
    resolve_quantize(args)  # ("none" -> None; a shape has no checkpoint to take a default from)
    dtype = "bfloat16" if args.quantize and args.dtype == "auto" else args.dtype
    print(f"building a random-weight {args.shape} model ({dtype}{', ' + args.quantize if args.quantize else ''}) …",
          file=sys.stderr)
    model = build_shape_model(args.shape, torch.float32 if dtype == "auto" else getattr(torch, dtype))
    model.prepare_for_inference(args.quantize, release=args.quantize is not None)  # inference only: codes kept
    if drafts := draft_precision(args.draft_quantize, model):
        model.quantize_drafts(drafts)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    counts = torch.rand(model.config.vocab_size, generator=g)  # random weights: any subset costs the same
    vocabs = {f"{n // 1024}k-token": DraftVocab.from_counts(counts, n) for n in (32768, 8192)}
    heads = {name: (lambda h, v=v: int(v.ids[v.logits(model, h[0, -1], 1).argmax()])) for name, v in vocabs.items()}
    iters = 2 if args.quick else 5
    costs = measure_costs(model, q_max=8, context=128, iters=iters, warmup=1, extra_heads=heads)
    title = (f"cost model, random-weight {args.shape} ({n_params / 1e6:.0f}M parameters, {model.dtype}"
             f"{', ' + args.quantize if args.quantize else ''}{', drafts ' + drafts if drafts else ''})")
    tables = {"measured": costs}
    print(format_costs(costs, title))
    print_speedups(costs)
    if args.shape in FULL_LAYERS:
        factor = FULL_LAYERS[args.shape] / model.config.num_hidden_layers
        tables["extrapolated"] = full = extrapolate_depth(costs, factor)
        print("\n" + format_costs(full, f"the same extrapolated to the real model's {FULL_LAYERS[args.shape]} layers "
                                          f"(time outside the output head x {factor:g})"))
        print_speedups(full)
    if args.variants:
        tables["variants"] = compare_variants(args.shape, args.variants, iters)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"costs_{args.shape}.json"
    path.write_text(json.dumps({"shape": args.shape, "dtype": str(model.dtype), "parameters": n_params, "machine": machine_info(),
                                **{f"costs_{k}" if k != "measured" else "costs": _costs_json(v) for k, v in tables.items()}},
                               indent=2))
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


def compare_variants(shape: str, variants: list[Variant], iters: int) -> dict:
    """The plain decode step of the same random weights in each variant's dtype / quantization, timed in turn
    (A B C A B C ...) so the machine's noise hits them alike. Returns {variant: seconds}."""
    base = build_shape_model(shape, torch.float32)
    models = {}
    for v in variants:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": torch.float32}[v.dtype]
        m = base if dtype == torch.float32 and v.quantize is None else copy.deepcopy(base).to(dtype)
        m.prepare_for_inference(v.quantize, release=v.quantize is not None)
        models[v.name] = m
    med = plain_step_seconds(models, iters)
    ref = med[variants[0].name]
    print("\nplain decode step by variant (same weights, interleaved): " + ", ".join(
        f"{n} {t * 1e3:.1f} ms ({ref / t:.2f}x {variants[0].name})" for n, t in med.items()))
    return {"plain_step_s": med}


def print_speedups(costs: dict) -> None:
    print("\nspeedup the cost model allows at acceptance a per position (full head / reduced heads):")
    for a in (0.9, 0.8, 0.7):
        row = []
        for k in range(1, len(costs["c_verify"])):
            full = speedup_table([a] * k, costs, k)[k]
            reduced = [speedup_table([a] * k, {**costs, "c_draft": c}, k)[k] for c in costs.get("c_draft_reduced", {}).values()]
            row.append(f"k={k}: {full:.2f}" + "".join(f" / {r:.2f}" for r in reduced))
        print(f"  a = {a}: " + ", ".join(row))


def bench_prompts(args, model, max_prompts: int | None, max_new: int) -> tuple[list[Prompt], list[list[int]], dict]:
    """The prompt set, tokenized and cut to fit the context; returns prompts, ids and notes on any cut."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError(f"{model.source_path} has no tokenizer.json: the benchmark prompts are text")
    prompts = load_prompts(args.prompts)
    if max_prompts:
        prompts = [p for kind in ("code", "text") for p in [q for q in prompts if q.kind == kind][:max_prompts]]
    prompt_ids = [tok.encode(p.text) for p in prompts]
    room = model.context_length - max_new - 16
    if room < 1:
        raise ValueError(f"--max-new-tokens {max_new} leaves no room for a prompt in the context of {model.context_length}")
    notes = {}
    for i, (p, ids) in enumerate(zip(prompts, prompt_ids)):
        if not ids:
            raise ValueError(f"prompt from {p.source or p.kind} encodes to no tokens")
        if len(ids) > room:  # keep the end, which the continuation depends on
            notes[f"prompt {i}"] = f"{len(ids)} tokens cut to the last {room} to fit the context"
            prompt_ids[i] = ids[-room:]
    return prompts, prompt_ids, notes


def bench_meta(args, model, prompts, prompt_ids, drafts, max_new: int, repeats: int, notes: dict) -> dict:
    return {
        "command": "mtp " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("mtp") else None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": model_name(args), "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size, "max_new_tokens": max_new, "repeats": repeats,
        "threads": torch.get_num_threads(), "draft_tokens": drafts, "machine": machine_info(),
        "quantize": args.quantize, "draft_vocab": args.draft_vocab, "draft_quantize": model.draft_quantize,
        "variants": [v.name for v in args.variants],
        "prompt_counts": {k: sum(p.kind == k for p in prompts) for k in ("code", "text")},
        "prompts": [{"kind": p.kind, "source": p.source, "tokens": len(ids)} for p, ids in zip(prompts, prompt_ids)],
        "notes": notes, "mean_accepted_length_note": ACCEPTED_LENGTH_NOTE,
    }


def write_report(out: Path, report: dict, md: str, summary: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "report.md").write_text(md + "\n")
    return plot(summary, out)


def cmd_bench(args) -> int:
    from tqdm import tqdm

    if args.shape:
        return cmd_shape(args)
    max_new = args.max_new_tokens or (24 if args.quick else 256)
    repeats = args.repeats or (2 if args.quick else 3)
    drafts = args.draft_tokens or ([1, 3, "auto"] if args.quick else [1, 2, 3, 4, "auto"])
    if max_new < 1 or repeats < 1:
        raise ValueError("--max-new-tokens and --repeats must be >= 1")

    model = load_from_args(args)
    default = Variant("", args.dtype, args.quantize, args.draft_vocab, args.compile, args.draft_quantize)
    variants = [default] + [replace(v, draft_quantize=v.draft_quantize or args.draft_quantize,
                                    draft_vocab=args.draft_vocab if v.draft_vocab is None else v.draft_vocab)
                            for v in args.variants]
    models = {default.model_key: model}
    for v in variants[1:]:
        if v.model_key not in models:
            m = load_model(model.source_path, dtype=v.dtype, device=model.device, quantize=v.quantize,
                           release=v.quantize is not None)
            if bits := draft_precision(v.draft_quantize, m):
                m.quantize_drafts(bits)
            models[v.model_key] = m
    prompts, prompt_ids, notes = bench_prompts(args, model, args.max_prompts or (1 if args.quick else None), max_new)
    # transformers runs in fp32 (its exact path on a CPU); its greedy output is checked against an fp32 mtp run, since
    # two bf16 implementations round differently and part ways after a few dozen tokens
    hf_model, hf_note = (None, "left out (--no-transformers)") if args.no_transformers else load_transformers(
        model.source_path, torch.float32, model.device)
    fp32_runs = [v for v in variants if v.quantize is None
                 and (v.dtype == "float32" or (v.dtype == "auto" and model.dtype == torch.float32))]
    hf_reference = plain_name(fp32_runs[0]) if fp32_runs else None
    if hf_model is not None and hf_reference is None:
        notes["transformers"] = "runs in fp32; its output is not compared here (add --variants fp32 to compare it)"
    if hf_note:
        notes["transformers"] = hf_note
    hf_mtp_note = transformers_mtp_note(hf_model) if hf_model is not None else None
    if hf_model is not None:
        notes[HF_MTP] = hf_mtp_note or ("transformers' own MTP decoding (fp32, one draft per MTP layer a round, its MTP "
                                        "layers loaded again on each call as its generate does); checked equal to its "
                                        "plain generate")
    tok = model.tokenizer
    pad = model.config.pad_token_id
    if pad is None:
        pad = tok.eos_token_id if tok.eos_token_id is not None else 0

    costs = None
    if not args.no_cost_model:
        print("measuring the cost model …", file=sys.stderr)
        ks = [k for k in drafts if isinstance(k, int)]
        costs = measure_costs(model, q_max=max(ks) + 1 if ks else 5, context=min(128, model.context_length - max_new - 16),
                              iters=3 if args.quick else 15)

    configs = configs_for(drafts, hf_model is not None, variants, with_transformers_mtp=hf_mtp_note is None)
    with tqdm(total=repeats * len(prompts) * len(configs), unit="run", file=sys.stderr, dynamic_ncols=True) as bar:
        runs, failed = run_interleaved(models, hf_model, configs, prompts, prompt_ids, max_new, repeats, pad, bar)
    if "auto" in drafts:  # what `auto` started from: a store file of an earlier process's, or nothing
        kept = policy_store.read()
        notes["auto"] = ("MTP_AUTO_STORE=0: started from nothing" if not policy_store.enabled() else
                         f"started from the measurements an earlier process kept ({', '.join(str(p) for p in kept)})"
                         if kept else "started from nothing (no measurements kept for these models and setups)")
    references = {c.name: c.reference for c in configs if c.engine == "mtp"}
    references[HF] = hf_reference or "(not compared)"
    references[HF_MTP] = HF  # lossless: transformers' greedy MTP decoding must give its own plain output
    problems = check_identical(runs, references) + [f"{name}: FAILED: {why}" for name, why in failed.items()]
    summary = summarize(runs, prompts, configs, costs)
    meta = bench_meta(args, model, prompts, prompt_ids, drafts, max_new, repeats, notes)
    report = {
        "meta": meta, "identical_outputs": not problems, "failed": failed, "mismatches": problems, "summary": summary,
        "best_fixed_k": {kind: best[1] for kind in summary if (best := best_fixed_k(summary[kind]))},
        "cost_model": _costs_json(costs) if costs else None,
        "runs": [{"config": r.config, "prompt": r.prompt, "repeat": r.repeat, "seconds": round(r.seconds, 5),
                  "new_tokens": len(r.tokens), "peak_rss_mb": round(r.peak_rss_mb, 1),
                  "rss_before_mb": None if r.rss_before_mb is None else round(r.rss_before_mb, 1), "stats": r.stats}
                 for r in runs],
    }
    profiles = {}
    if not args.no_profile:
        print("profiling one round per configuration …", file=sys.stderr)
        ks = [k for k in drafts if isinstance(k, int)]
        k_prof = 3 if 3 in ks else (max(ks) if ks else None)
        for v in variants:
            for k in [None] + ([k_prof] if k_prof else []):
                name = plain_name(v) if k is None else f"mtp {v.name + ' ' if v.name else ''}k={k}"
                profiles[name] = round_profile(models[v.model_key], prompt_ids[0], k, v.compiled, min(16, max_new))
    report["round_profile"] = profiles
    md = markdown_report(summary, meta) + ("\n\n" + format_costs(costs, "cost model (this model)") if costs else "")
    if profiles:
        md += ("\n\n#### where a round's time goes (first prompt, greedy; see `mtp/bench/profile.py`)\n\n"
               + format_profile(profiles))
    plots = write_report(args.out, report, md, summary)

    m = meta["machine"]
    print(f"\nmtp bench · {meta['model']} ({meta['parameters'] / 1e6:.1f}M parameters, {meta['dtype']}, {meta['device']}) · "
          f"{m['cpu']} ({m['cpu_capability']}), {m['logical_cpus']} logical CPUs, {meta['threads']} thread(s) · "
          f"torch {m['torch']} · int8/int4: {m['int8_int4_kernels']}\n")
    print(md)
    print(f"\nwrote {args.out / 'report.json'}, {args.out / 'report.md'}"
          + "".join(f", {p}" for p in plots) + ("" if plots else " (no plots: matplotlib is not installed)"), file=sys.stderr)
    if problems:
        print(f"\nmtp bench: FAILED ({len(problems)} problem(s)): a configuration failed or greedy outputs differ:",
              file=sys.stderr)
        for line in problems[:10]:
            print("  " + line, file=sys.stderr)
        return 1
    print("greedy outputs identical in every configuration", file=sys.stderr)
    return 0
