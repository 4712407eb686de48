"""`mtp` command line: generate, and the subcommands of the other parts (data, train, heal, bench, serve, convert,
quantize)."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from .bench.cli import register as register_bench
from .check import register as register_check
from .cli_common import add_compile_arg, add_model_args, add_sampling_args, load_from_args, sampling_kwargs
from .convert import register as register_convert
from .data.cli import register as register_data
from .export import register as register_export
from .quantize import register as register_quantize
from .serve.cli import register as register_serve
from .train.cli import register as register_train

# --show-drafts: ANSI colour per token kind (decode/session.py TOKEN_KINDS); prefill and plain tokens keep the default
KIND_COLOURS = {"draft": "\x1b[32m", "correction": "\x1b[31m", "bonus": "\x1b[36m"}
KIND_NAMES = {"draft": "green = accepted MTP draft", "correction": "red = the backbone's correction of a rejected draft",
              "bonus": "cyan = bonus token after all drafts were accepted"}
RESET = "\x1b[0m"


def legend(colour: bool) -> str:
    """One line naming the --show-drafts colours (each name in its colour when `colour`)."""
    parts = [f"{KIND_COLOURS[k]}{name}{RESET}" if colour else name for k, name in KIND_NAMES.items()]
    return "[drafts: " + ", ".join(parts) + "; default colour: prefill / plain step]"


class TextPrinter:
    """Writes a generation's text to `out` as it grows, holding back nothing but undecodable bytes. With
    `colour`, each new character is wrapped in the ANSI colour of the kind of the token that produced it (a
    character split across tokens takes its last token's kind)."""

    def __init__(self, decode: Callable[[list[int]], str], out: TextIO, colour: bool = False):
        self.decode, self.out, self.colour = decode, out, colour
        self.printed = ""
        self.attributed = ""  # decoded text of the first n_attributed tokens
        self.n_attributed = 0
        self.char_kinds: list[str] = []  # the kind of each character of `attributed`
        self.last_kind = "plain"

    def push(self, tokens: list[int], kinds: list[str]) -> None:
        """After a step: `tokens`/`kinds` are all new tokens so far and their kinds; writes the new text."""
        text = self.decode(tokens)
        if text.endswith("\ufffd") or len(text) <= len(self.printed) or not text.startswith(self.printed):
            return
        if self.colour:
            self._attribute(tokens, kinds)
        self._write(text)

    def finish(self, final: str) -> None:
        """Writes the rest of the final text (when it extends what was printed) and a newline."""
        if final.startswith(self.printed):
            self._write(final)
        self.out.write("\n")
        self.out.flush()

    def _attribute(self, tokens: list[int], kinds: list[str]) -> None:
        # decode each new token's prefix: the characters it completes are its own
        for n in range(self.n_attributed + 1, len(tokens) + 1):
            text = self.decode(tokens[:n])
            if text.endswith("\ufffd") or not text.startswith(self.attributed):
                continue  # an incomplete character (or unstable decoding): the next token completes it
            self.char_kinds += [kinds[n - 1]] * (len(text) - len(self.attributed))
            self.attributed, self.n_attributed = text, n
        if kinds:
            self.last_kind = kinds[-1]

    def _write(self, text: str) -> None:
        new = text[len(self.printed):]
        if self.colour:
            start = len(self.printed)
            kind_at = lambda i: self.char_kinds[start + i] if start + i < len(self.char_kinds) else self.last_kind
            spans = []
            for kind, group in itertools.groupby(range(len(new)), key=kind_at):
                chunk = "".join(new[i] for i in group)
                spans.append(f"{KIND_COLOURS[kind]}{chunk}{RESET}" if kind in KIND_COLOURS else chunk)
            new = "".join(spans)
        self.out.write(new)
        self.out.flush()
        self.printed = text


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
    kw = dict(max_new_tokens=args.max_new_tokens, **sampling_kwargs(args, model), seed=args.seed,
              stop=args.stop, draft_tokens=args.draft_tokens, draft_vocab=args.draft_vocab, compile=args.compile)
    t0 = time.perf_counter()
    s = stream(model, ids, **kw)
    if args.json:
        for _ in s:
            pass
    else:
        colour = args.show_drafts and sys.stdout.isatty()  # piped output stays plain text
        printer = TextPrinter(tok.decode, sys.stdout, colour)
        for _ in s:
            printer.push(s.session.text_tokens, s.session.kinds)
        printer.finish(s.result.text or "")
    r = s.result
    wall = time.perf_counter() - t0
    if args.json:
        out = {"prompt": prompt, "prompt_tokens": ids, "tokens": r.tokens, "text": r.text,
               "finish_reason": r.finish_reason, "kinds": r.kinds, "draft_tokens": args.draft_tokens,
               "draft_quantize": model.draft_quantize, "draft_vocab": args.draft_vocab,
               "wall_time_s": round(wall, 5), "stats": r.stats.as_dict()}
        print(json.dumps(out, ensure_ascii=False))
    else:
        st = r.stats
        print(f"[{st.new_tokens} tokens in {st.time_total:.2f}s, {st.tokens_per_second:.1f} tok/s; "
              f"mean accepted length {st.mean_accepted_length:.2f} tokens/forward (bonus included); "
              f"acceptance by position {[round(a, 2) for a in st.acceptance_per_position]}]", file=sys.stderr)
        if colour:
            print(legend(sys.stderr.isatty()), file=sys.stderr)
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
    g.add_argument("--show-drafts", action="store_true",
                   help="on a terminal, colour each token by where it came from: accepted MTP draft (green), the "
                        "backbone's correction (red), bonus token (cyan); piped output stays plain text")
    add_sampling_args(g)
    add_compile_arg(g)
    g.set_defaults(func=cmd_generate)
    for register in (register_data, register_train, register_bench, register_serve, register_check, register_convert,
                     register_quantize, register_export):
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
