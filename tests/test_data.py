"""`mtp data`: BPE tokenizer (also loadable by transformers), packed shards, split by file, bad files reported."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from mtp.data.build import build_dataset
from mtp.data.corpus import find_documents, split_by_file
from mtp.data.shards import TokenShards, token_dtype

NAMES = ["alpha", "beta", "gamma", "delta", "value", "items", "total", "result", "count", "index"]


def make_corpus(root: Path, n_files: int = 40, seed: int = 0) -> Path:
    """Deterministic small Python-like files: repetitive enough for a tiny model to learn quickly."""
    rng = random.Random(seed)
    src = root / "corpus"
    (src / "pkg").mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        lines = []
        for _ in range(6):
            f, a, b = rng.sample(NAMES, 3)
            lines += [f"def {f}_{i % 7}({a}, {b}):", f"    {a} = {a} + {b}", f"    return {a} * {b}", ""]
        (src / "pkg" / f"mod_{i:03d}.py").write_text("\n".join(lines))
    return src


def build_toy(root: Path, vocab_size: int = 320, **kw) -> Path:
    out = root / "data"
    build_dataset([make_corpus(root)], out, vocab_size=vocab_size, val_fraction=0.15, progress=False, quiet=True,
                  extensions=(".py",), **kw)
    return out


def test_build_split_shards_and_roundtrip(tmp_path, capsys):
    src = make_corpus(tmp_path)
    (src / "pkg" / "bad_latin1.py").write_bytes(b"x = '\xe9t\xe9'\n")
    (src / "pkg" / "empty.py").write_text("")
    out = tmp_path / "data"
    index = build_dataset([src], out, vocab_size=320, val_fraction=0.15, extensions=(".py",), progress=False)
    err = capsys.readouterr().err
    assert "bad_latin1.py" in err and "UnicodeDecodeError" in err          # reported, never silent
    reasons = {Path(s["path"]).name: s["reason"] for s in index["skipped"]}
    assert reasons["empty.py"] == "empty" and "unreadable" in reasons["bad_latin1.py"]
    assert index["dtype"] == "uint16" and index["vocab_size"] <= 320
    val = (out / "val_files.txt").read_text().split()
    train = (out / "train_files.txt").read_text().split()
    assert val and train and not set(val) & set(train)                      # split by file
    assert len(val) == index["splits"]["val"]["documents"]

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    assert index["vocab_size"] == tok.get_vocab_size() and index["eos_token_id"] == eos
    stream = TokenShards(out, "val")
    assert len(stream) == index["splits"]["val"]["tokens"]
    ids = stream.read(0, len(stream)).tolist()
    first = ids[: ids.index(eos)]
    assert tok.decode(first) == (src / val[0].split("/", 1)[1]).read_text()  # byte-level: exact round trip


def test_split_is_deterministic_and_stable(tmp_path):
    docs, _ = find_documents([make_corpus(tmp_path)], (".py",))
    a = split_by_file(docs, 0.2, seed=3)
    b = split_by_file(list(reversed(docs)), 0.2, seed=3)
    assert [d.name for d in a[1]] == [d.name for d in b[1]]
    fewer = split_by_file(docs[:-5], 0.2, seed=3)[1]                         # removing files moves no other file
    assert {d.name for d in fewer} <= {d.name for d in a[1]}
    with pytest.raises(ValueError, match="val_fraction"):
        split_by_file(docs, 1.5)


def test_transformers_autotokenizer_loads_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = build_toy(tmp_path)
    from mtp.io import Tokenizer

    ours = Tokenizer.from_dir(out)
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def alpha(beta):\n    return beta  # é\n"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == ours.eos_token_id
    assert hf.decode(ours.encode(text)) == text


def test_jsonl_and_errors(tmp_path):
    f = tmp_path / "docs.jsonl"
    rows = [json.dumps({"text": f"line {i} " * 20}) for i in range(30)]
    f.write_text("\n".join(rows[:10] + ["{not json", json.dumps({"other": 1})] + rows[10:]) + "\n")
    index = build_dataset([f], tmp_path / "d", vocab_size=300, val_fraction=0.2, progress=False, quiet=True)
    reasons = [s["reason"] for s in index["skipped"]]
    assert any("invalid JSON" in r for r in reasons) and any("no string field" in r for r in reasons)
    assert index["splits"]["train"]["documents"] + index["splits"]["val"]["documents"] == 30
    assert all(":" in n for n in (tmp_path / "d" / "val_files.txt").read_text().split())  # records named path:LINE
    with pytest.raises(FileNotFoundError, match="nope"):
        build_dataset([tmp_path / "nope"], tmp_path / "e", progress=False)
    with pytest.raises(FileNotFoundError, match="index.json"):
        TokenShards(tmp_path, "train")


def test_token_dtype_by_vocab():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_cli_data(tmp_path):
    from mtp.cli import main

    src = make_corpus(tmp_path)
    assert main(["data", str(src), "--out", str(tmp_path / "o"), "--vocab-size", "300", "--ext", ".py", "--quiet"]) == 0
    assert (tmp_path / "o" / "index.json").exists() and (tmp_path / "o" / "tokenizer_config.json").exists()
