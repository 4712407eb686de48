"""The benchmark's prompt set: JSONL records {"kind": "code" | "text", "text": ..., "source": ...}.

The shipped set (`mtp/assets/bench_prompts.jsonl`) holds code prompts cut from Python standard-library
files of the data pipeline's *validation* split (`mtp.data.corpus.split_by_file` with the defaults the
shipped model was trained with, so no prompt comes from a training file) and a few natural-language
prompts. Each code prompt ends right after a function's signature (and docstring), so the model writes
the body. `python -m mtp.bench.prompts` rebuilds the file deterministically.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("code", "text")
DEFAULT_PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "bench_prompts.jsonl"

TEXT_PROMPTS = [
    "The history of the printing press is a story of small improvements that added up. Before movable type, "
    "books were copied by hand, which made them rare and expensive. When metal type, oil-based ink and the "
    "screw press came together in the fifteenth century,",
    "To make a good cup of tea, start with fresh cold water and bring it to the boil. Warm the pot first, "
    "then add one spoonful of leaves for each cup. Pour the water over the leaves and",
    "Dear team,\n\nThank you all for the work on this release. Before we plan the next one, I would like to "
    "look back at what went well and what did not. First,",
    "Rivers shape the land they cross. Over thousands of years a river cuts its valley, carries sand and "
    "stones downstream and drops them where the water slows down. This is why",
]


@dataclass
class Prompt:
    kind: str  # "code" or "text"
    text: str
    source: str = ""  # where the text was cut from (a file name, or "hand-written")


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Read a prompt JSONL file (default: the shipped set); every record needs "kind" and "text"."""
    path = Path(path) if path is not None else DEFAULT_PROMPTS
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str) or not rec["text"]:
            raise ValueError(f"{path}:{n}: each record needs a non-empty string field 'text'")
        kind = rec.get("kind", "text")
        if kind not in KINDS:
            raise ValueError(f"{path}:{n}: 'kind' must be one of {KINDS}, got {kind!r}")
        prompts.append(Prompt(kind, rec["text"], rec.get("source", "")))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def cut_code_prompt(text: str, max_chars: int = 1200, min_chars: int = 400) -> str | None:
    """Cut a prompt from a Python file: up to `max_chars` of whole lines ending right after a `def` line
    (and its one-line or multi-line docstring). The first def with at least `min_chars` before it wins."""
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if not (stripped.startswith("def ") and line.rstrip().endswith(":")) or offsets[i] < min_chars:
            continue
        end = i + 1
        if end < len(lines) and lines[end].lstrip().startswith(('"""', "'''")):  # keep the docstring
            quote = lines[end].lstrip()[:3]
            j = end
            while j < len(lines):
                body = lines[j].lstrip()[3:] if j == end else lines[j]
                if quote in body:
                    break
                j += 1
            end = j + 1
        if offsets[end] - offsets[i] > max_chars // 2:
            continue  # a huge docstring would crowd the context out
        start = 0
        while offsets[end] - offsets[start] > max_chars:
            start += 1
        return "".join(lines[start:end])
    return None


def build_code_prompts(n: int, val_fraction: float = 0.05, seed: int = 0, max_chars: int = 1200) -> list[Prompt]:
    """`n` code prompts from distinct standard-library .py files of the data pipeline's validation split
    (same split function, fraction and seed as `mtp data` defaults), skipping tests, in name order."""
    from ..data.corpus import default_sources, find_documents, read_document, split_by_file

    docs, _ = find_documents(default_sources())
    _, val = split_by_file(docs, val_fraction, seed)
    prompts = []
    for doc in val:
        if doc.path.suffix != ".py" or "/test" in doc.name or "idlelib" in doc.name:
            continue
        try:
            text = read_document(doc)
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        cut = cut_code_prompt(text, max_chars)
        if cut is not None:
            prompts.append(Prompt("code", cut, doc.name))
        if len(prompts) == n:
            break
    return prompts


def write_prompts(prompts: list[Prompt], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(p), ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="rebuild the shipped benchmark prompt set")
    ap.add_argument("--out", type=Path, default=DEFAULT_PROMPTS)
    ap.add_argument("--code", type=int, default=5, help="number of code prompts")
    ap.add_argument("--text", type=int, default=2, help=f"number of natural-language prompts (at most {len(TEXT_PROMPTS)})")
    ap.add_argument("--val-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    prompts = build_code_prompts(args.code, args.val_fraction, args.seed)
    prompts += [Prompt("text", t, "hand-written") for t in TEXT_PROMPTS[: args.text]]
    write_prompts(prompts, args.out)
    print(f"wrote {len(prompts)} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
