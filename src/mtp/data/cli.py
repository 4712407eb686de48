"""`mtp data`: build a tokenizer and packed token shards (default corpus: the stdlib's sources)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .corpus import DEFAULT_EXTENSIONS, default_sources


def cmd_data(args) -> int:
    from .build import build_dataset

    sources = args.sources or default_sources()
    exts = tuple(args.ext) if args.ext else ((".py",) if not args.sources else DEFAULT_EXTENSIONS + (".jsonl",))
    index = build_dataset(sources, args.out, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                          seed=args.seed, extensions=exts, jsonl_field=args.jsonl_field,
                          tokenizer_from=args.tokenizer_from, progress=not args.quiet, quiet=args.quiet)
    s = index["splits"]
    print(f"mtp data: {args.out}: vocab {index['vocab_size']} ({index['dtype']}); train {s['train']['tokens']:,} tokens "
          f"in {s['train']['documents']} files, val {s['val']['tokens']:,} tokens in {s['val']['documents']} files "
          f"(listed in val_files.txt); {len(index['skipped'])} skipped")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="build a BPE tokenizer and packed token shards (default: the stdlib sources)")
    p.add_argument("sources", nargs="*", type=Path,
                   help="folders, text files or .jsonl files (default: this interpreter's stdlib .py files)")
    p.add_argument("--out", type=Path, required=True, help="data folder to write")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--val-fraction", type=float, default=0.05, help="fraction of files held out (split by file)")
    p.add_argument("--seed", type=int, default=0, help="seed of the file split")
    p.add_argument("--ext", action="append", default=None, help="file extension to include (repeatable)")
    p.add_argument("--jsonl-field", default="text", help="field holding the text in .jsonl records")
    p.add_argument("--tokenizer-from", type=Path, default=None, help="reuse this folder's tokenizer.json")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_data)
