"""A SentencePiece BPE model (`tokenizer.model`: Llama 2's, shipped with Meta's multi-token models) as a `tokenizers`
tokenizer (`tokenizer.json`), encoding and decoding exactly as SentencePiece does - the conversion transformers
applies to Llama's tokenizer (its legacy mode): the vocabulary and scores as they are, BPE merges rebuilt from them
(every split of a piece into two pieces of the vocabulary, ranked by the merged piece's score), byte fallback,
spaces as U+2581 with one prepended, and the inverse on decoding. Models this does not reproduce exactly (unigram,
no byte fallback, whitespace collapsing, a normalization rule) are refused. Needs `sentencepiece` and `protobuf`
(`mtp[convert]`)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, normalizers
from tokenizers.models import BPE

SPACE = "\u2581"


def read_sentencepiece(path: str | Path):
    """The SentencePieceProcessor of a `tokenizer.model` (a clear error naming the file when it is not one)."""
    import sentencepiece

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no SentencePiece model there")
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path}: not a SentencePiece model ({e})") from None
    return sp


def bpe_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges that rebuild SentencePiece's BPE: each piece split at every point into two pieces of the vocabulary,
    most probable merged piece first (ties: by the pieces' ids)."""
    merges = []
    for piece, score in scores.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(left, right, score) for left, right in splits]
    merges.sort(key=lambda m: m[2], reverse=True)  # stable: equal scores keep the order above
    return [(left, right) for left, right, _ in merges]


def check_spec(path, sp) -> None:
    """Refuse a model whose encoding the conversion would not reproduce (the message names the setting)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp.serialized_model_proto())
    t, norm = proto.trainer_spec, proto.normalizer_spec
    want = {"trainer_spec.model_type": (t.model_type, t.BPE), "trainer_spec.byte_fallback": (t.byte_fallback, True),
            "normalizer_spec.add_dummy_prefix": (norm.add_dummy_prefix, True),
            "normalizer_spec.remove_extra_whitespaces": (norm.remove_extra_whitespaces, False),
            "normalizer_spec.name": (norm.name, "identity")}
    for key, (got, expect) in want.items():
        if got != expect:
            raise ValueError(f"{path}: SentencePiece {key} is {got!r}; only {expect!r} converts exactly (Llama's)")


def sentencepiece_to_tokenizer(path: str | Path) -> tuple[Tokenizer, dict]:
    """`tokenizer.model` -> (the `tokenizers` Tokenizer, the tokenizer_config.json dict naming bos/eos/unk)."""
    sp = read_sentencepiece(path)
    check_spec(path, sp)
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    scores = {sp.id_to_piece(i): sp.get_score(i) for i in range(n)}
    if len(vocab) != n:
        raise ValueError(f"{path}: the SentencePiece model repeats a piece")
    special = {i: sp.id_to_piece(i) for i in (sp.unk_id(), sp.bos_id(), sp.eos_id()) if i >= 0}
    unk = special.get(sp.unk_id())
    tok = Tokenizer(BPE(vocab, bpe_merges(vocab, scores), unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.add_special_tokens([AddedToken(piece, normalized=False, special=True) for _, piece in sorted(special.items())])
    config = {"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": True, "add_eos_token": False,
              "bos_token": special.get(sp.bos_id()), "eos_token": special.get(sp.eos_id()), "unk_token": unk,
              "legacy": True}
    return tok, {k: v for k, v in config.items() if v is not None}


def write_tokenizer_files(tok: Tokenizer, config: dict) -> dict[str, str]:
    """The files' texts: {'tokenizer.json': ..., 'tokenizer_config.json': ...}."""
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}
