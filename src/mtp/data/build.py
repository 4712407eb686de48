"""`mtp data`: sources -> split by file -> BPE trained on the train split -> packed shards + index."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from .bpe import EOS, save_tokenizer, train_bpe
from .corpus import DEFAULT_EXTENSIONS, find_documents, iter_texts, split_by_file
from .shards import INDEX, ShardWriter, token_dtype, write_token_frequencies


def _report(skipped: list[tuple[str, str]], start: int, quiet: bool) -> None:
    """Print every unreadable input; empty files are counted (they carry no tokens)."""
    new = skipped[start:]
    empty = [p for p, r in new if r == "empty"]
    for p, r in new:
        if r != "empty" and not quiet:
            print(f"mtp data: skipped {p}: {r}", file=sys.stderr)
    if empty and not quiet:
        print(f"mtp data: skipped {len(empty)} empty file(s) (listed in index.json)", file=sys.stderr)


def build_dataset(sources: list[Path], out: Path, vocab_size: int = 8192, val_fraction: float = 0.05,
                  seed: int = 0, extensions: tuple[str, ...] = DEFAULT_EXTENSIONS, jsonl_field: str = "text",
                  tokenizer_from: Path | None = None, progress: bool = True, quiet: bool = False,
                  batch_docs: int = 256) -> dict:
    """Build a data folder; returns the index dict (also written to `out/index.json`).

    `tokenizer_from`: reuse the tokenizer of that folder (e.g. a checkpoint) instead of training one.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    docs, skipped = find_documents(sources, extensions, jsonl_field)
    if not docs:
        raise ValueError(f"no documents with extensions {extensions} under {[str(s) for s in sources]}")
    train, val = split_by_file(docs, val_fraction, seed)
    _report(skipped, 0, quiet)

    n_skip = len(skipped)
    if tokenizer_from is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer_from) / "tokenizer.json"))
        save_tokenizer(tok, out)
        cfg = Path(tokenizer_from) / "tokenizer_config.json"
        if cfg.exists():
            (out / "tokenizer_config.json").write_text(cfg.read_text())
    else:
        texts = (t for _, t in iter_texts(train, skipped, jsonl_field, progress, desc="tokenizer"))
        tok = train_bpe(texts, vocab_size)
        save_tokenizer(tok, out)
        skipped = skipped[:n_skip]  # the shard pass below reports the same files again
    vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id(EOS)
    if eos_id is None:
        raise ValueError(f"tokenizer has no {EOS} token")
    dtype = token_dtype(vocab)
    splits = {}
    for name, part in (("train", train), ("val", val)):
        for old in out.glob(f"{name}-*.bin"):
            old.unlink()
        w = ShardWriter(out, name, dtype)
        before = len(skipped)
        buf = []
        bar = tqdm(total=len(part), desc=f"tokenize {name}", unit="doc", disable=not progress, mininterval=1.0)
        used = []

        def flush(buf=buf, used=used, w=w, bar=bar):
            for (doc, _), enc in zip(buf, tok.encode_batch([t for _, t in buf])):
                w.add(enc.ids + [eos_id])
                used.append(doc.name)
            bar.update(len(buf))
            buf.clear()

        for doc, text in iter_texts(part, skipped, jsonl_field):
            buf.append((doc, text))
            if len(buf) >= batch_docs:
                flush()
        flush()
        bar.close()
        _report(skipped, before, quiet)
        splits[name] = {**w.summary(), "names": used}
    (out / "val_files.txt").write_text("".join(n + "\n" for n in splits["val"]["names"]))
    (out / "train_files.txt").write_text("".join(n + "\n" for n in splits["train"]["names"]))
    for s in splits.values():
        s.pop("names")
    index = {
        "version": 1, "dtype": dtype.name, "vocab_size": vocab, "eos_token_id": eos_id,
        "sources": [str(s) for s in sources], "val_fraction": val_fraction, "seed": seed,
        "splits": splits, "skipped": [{"path": p, "reason": r} for p, r in skipped],
    }
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    write_token_frequencies(out)
    return index
