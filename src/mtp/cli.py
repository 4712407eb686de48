"""`mtp` command line: generate, and the subcommands of the other parts (data, train, heal, bench, serve)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .bench.cli import register as register_bench
from .cli_common import add_model_args, add_sampling_args, load_from_args
from .data.cli import register as register_data
from .serve.cli import register as register_serve
from .train.cli import register as register_train


def cmd_generate(args) -> int:
    from .decode import stream

    model = load_from_args(args)
    tok = model.tokenizer
    if args.prompt is None and args.prompt_file is None:
        raise SystemExit("mtp generate: give --prompt TEXT or --prompt-file FILE")
    prompt = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text()
    if tok is None:
        raise SystemExit(f"mtp generate: {model.source_path} has no tokenizer.json")
    if args.chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tok.encode(prompt)
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
              stop=args.stop, draft_tokens=args.draft_tokens, draft_vocab=args.draft_vocab)
    t0 = time.perf_counter()
    s = stream(model, ids, **kw)
    if args.json:
        for _ in s:
            pass
    else:
        printed = ""
        for _ in s:  # print text as it is produced, holding back nothing but undecodable bytes
            text = tok.decode(s.session.new_tokens)
            if not text.endswith("\ufffd") and len(text) > len(printed) and text.startswith(printed):
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
        final = s.result.text or ""
        if final.startswith(printed):
            sys.stdout.write(final[len(printed):])
        sys.stdout.write("\n")
    r = s.result
    wall = time.perf_counter() - t0
    if args.json:
        out = {"prompt": prompt, "prompt_tokens": ids, "tokens": r.tokens, "text": r.text,
               "finish_reason": r.finish_reason, "draft_tokens": args.draft_tokens,
               "wall_time_s": round(wall, 5), "stats": r.stats.as_dict()}
        print(json.dumps(out, ensure_ascii=False))
    else:
        st = r.stats
        print(f"[{st.new_tokens} tokens in {st.time_total:.2f}s, {st.tokens_per_second:.1f} tok/s; "
              f"mean accepted length {st.mean_accepted_length:.2f} tokens/forward (bonus included); "
              f"acceptance by position {[round(a, 2) for a in st.acceptance_per_position]}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text (MTP speculative decoding by default)")
    add_model_args(g)
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print token ids, text, timing and statistics as JSON")
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    for register in (register_data, register_train, register_bench, register_serve):
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"mtp {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
