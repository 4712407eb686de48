"""Corpus discovery: text/code folders, single files and JSONL, with a deterministic split by file.

A `Document` is one unit of the split: a whole file, or one record of a JSONL file (named `path:LINE`).
Unreadable or undecodable inputs are never dropped silently: they are returned in `skipped` with a reason.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_EXTENSIONS = (".py", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".js", ".ts", ".rs", ".go", ".java",
                      ".sh", ".toml", ".yaml", ".yml", ".json", ".html", ".css")


@dataclass(frozen=True)
class Document:
    """`name`: stable id used for the split (relative path, or `path:LINE` for a JSONL record)."""

    name: str
    path: Path
    line: int | None = None  # JSONL record (1-based line), None for a whole file


def default_sources() -> list[Path]:
    """The running interpreter's standard library folder (its .py sources are the default corpus)."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def _skip_dir(p: Path) -> bool:
    return any(part in ("site-packages", "dist-packages", "__pycache__") or part.startswith(".") for part in p.parts)


def find_documents(sources: list[Path], extensions: tuple[str, ...] = DEFAULT_EXTENSIONS,
                   jsonl_field: str = "text") -> tuple[list[Document], list[tuple[str, str]]]:
    """Expand folders/files into documents (sorted by name). Returns (documents, skipped [(path, reason)]).

    Folders are walked for files with `extensions` (site-packages, hidden and __pycache__ folders are
    left out). `.jsonl` files give one document per non-empty line holding `jsonl_field`.
    """
    docs: list[Document] = []
    skipped: list[tuple[str, str]] = []
    for src in sources:
        src = Path(src)
        if not src.exists():
            raise FileNotFoundError(f"data source {src} does not exist")
        if src.is_dir():
            files = sorted(p for p in src.rglob("*") if p.is_file() and p.suffix in extensions
                           and not _skip_dir(p.relative_to(src)))
            base = src
        else:
            files, base = [src], src.parent
        for f in files:
            rel = f"{src.name}/{f.relative_to(base)}" if src.is_dir() else f.name
            if f.suffix == ".jsonl":
                docs_f, skipped_f = _jsonl_documents(f, rel, jsonl_field)
                docs += docs_f
                skipped += skipped_f
            else:
                docs.append(Document(rel, f))
    names = [d.name for d in docs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[0]
        raise ValueError(f"two data sources give the same document name {dup!r}: pass distinct folders")
    return sorted(docs, key=lambda d: d.name), skipped


def _jsonl_documents(f: Path, rel: str, field: str) -> tuple[list[Document], list[tuple[str, str]]]:
    docs, skipped = [], []
    try:
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    skipped.append((f"{f}:{n}", f"invalid JSON ({e.msg})"))
                    continue
                if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
                    skipped.append((f"{f}:{n}", f"no string field {field!r}"))
                    continue
                docs.append(Document(f"{rel}:{n}", f, n))
    except (OSError, UnicodeDecodeError) as e:
        skipped.append((str(f), f"unreadable ({type(e).__name__}: {e})"))
    return docs, skipped


def read_document(doc: Document, jsonl_field: str = "text") -> str:
    """The document's text. Raises OSError / UnicodeDecodeError / ValueError for bad input."""
    if doc.line is None:
        data = doc.path.read_bytes()
        if b"\x00" in data:
            raise ValueError("binary file (NUL bytes)")
        return data.decode("utf-8")
    with open(doc.path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if n == doc.line:
                return json.loads(line)[jsonl_field]
    raise ValueError(f"line {doc.line} vanished")


def iter_texts(docs: list[Document], skipped: list[tuple[str, str]], jsonl_field: str = "text",
               progress: bool = False, desc: str = "read") -> Iterator[tuple[Document, str]]:
    """Yield (document, text), appending unreadable/empty ones to `skipped` with the reason."""
    from tqdm import tqdm

    jsonl_cache: dict[Path, list[str]] = {}
    for doc in tqdm(docs, desc=desc, unit="doc", disable=not progress, mininterval=1.0):
        try:
            if doc.line is not None:  # read each JSONL file once
                if doc.path not in jsonl_cache:
                    jsonl_cache.clear()
                    jsonl_cache[doc.path] = doc.path.read_text(encoding="utf-8").splitlines()
                text = json.loads(jsonl_cache[doc.path][doc.line - 1])[jsonl_field]
            else:
                text = read_document(doc)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            skipped.append((doc.name, f"unreadable ({type(e).__name__}: {e})"))
            continue
        if not text.strip():
            skipped.append((doc.name, "empty"))
            continue
        yield doc, text


def split_by_file(docs: list[Document], val_fraction: float, seed: int = 0) -> tuple[list[Document], list[Document]]:
    """Deterministic (train, val) split on a hash of (seed, document name): stable when files are added.

    At least one validation document when there are two or more documents and val_fraction > 0.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")

    def u(d: Document) -> float:
        h = hashlib.sha1(f"{seed}:{d.name}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64

    scored = sorted(docs, key=u)
    val = [d for d in scored if u(d) < val_fraction]
    if not val and val_fraction > 0 and len(docs) >= 2:
        val = scored[:1]
    val_names = {d.name for d in val}
    train = [d for d in docs if d.name not in val_names]
    return train, sorted(val, key=lambda d: d.name)
