"""`Tokenizer.max_chars_per_token`: the bound that lets the server refuse a prompt that cannot fit the context
without tokenizing it - it must hold for every text (or be None where no bound holds), and `encode` must give the
ids `tokenizers` gives."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers, trainers

from mtp.io import Tokenizer
from serve_support import CORPUS, EOS, train_tokenizer

TEXTS = ["        " * 40 + "x", "Héllo wörld ✓ 日本語 " * 20, "e\u0301\u0323" * 50, "<|endoftext|>" * 9, "".join(CORPUS)]


def tokens_per_text(tok: Tokenizer) -> list[tuple[int, int]]:
    rng = random.Random(0)
    alphabet = "".join(CORPUS) + " \n\t\u0301ﬁ"
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 400))) for _ in range(200)]
    return [(len(t), len(tok.encode(t))) for t in texts]


def bpe(normalizer=None, pre_tokenizer=None, unk: str | None = None, fuse_unk: bool = False,
        every_byte: bool = True) -> HFTokenizer:
    """A BPE trained on CORPUS; `every_byte`: its vocabulary holds the 256 byte-level symbols."""
    tok = HFTokenizer(models.BPE(unk_token=unk, fuse_unk=fuse_unk))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    special = [EOS] + ([unk] if unk else [])
    alphabet = pre_tokenizers.ByteLevel.alphabet() if every_byte else []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=special, initial_alphabet=alphabet,
                                                        show_progress=False))
    return tok


def test_the_bound_holds_for_byte_level_bpe():
    tok = Tokenizer(train_tokenizer(), {"eos_token": EOS})
    bound = tok.max_chars_per_token
    assert bound == max(len(k) for k in tok.tok.get_vocab())  # the longest vocabulary entry
    for chars, n in tokens_per_text(tok):
        assert chars <= n * bound


@pytest.mark.parametrize("normalizer,factor", [(normalizers.NFC(), 4), (normalizers.NFKC(), 4),
                                               (normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase()]), 1)])
def test_unicode_normalization_widens_the_bound(normalizer, factor):
    tok = Tokenizer(bpe(normalizer, pre_tokenizers.ByteLevel()))
    longest = max(len(k) for k in tok.tok.get_vocab())
    assert tok.max_chars_per_token == factor * longest
    for chars, n in tokens_per_text(tok):
        assert chars <= n * tok.max_chars_per_token


@pytest.mark.parametrize("kw", [
    {"pre_tokenizer": pre_tokenizers.Whitespace()},  # drops whitespace: a 10 MB run of spaces is no token at all
    {"pre_tokenizer": pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(), pre_tokenizers.WhitespaceSplit()])},
    {"normalizer": normalizers.Strip()},
    {"normalizer": normalizers.Replace("a", "")},
    {"pre_tokenizer": pre_tokenizers.Split(" ", behavior="removed")},
    {"unk": "<unk>", "fuse_unk": True, "pre_tokenizer": pre_tokenizers.Metaspace(), "every_byte": False},  # a run of
    # unknown characters is one token
    {"pre_tokenizer": pre_tokenizers.Metaspace(), "every_byte": False},  # no unknown token: unknown characters vanish
    {"pre_tokenizer": pre_tokenizers.ByteLevel(), "every_byte": False},  # bytes missing from the vocabulary vanish
])
def test_no_bound_where_text_can_vanish(kw):
    assert Tokenizer(bpe(**kw)).max_chars_per_token is None


def test_an_unknown_token_per_character_keeps_the_bound():
    tok = Tokenizer(bpe(pre_tokenizer=pre_tokenizers.Metaspace(), unk="<unk>", every_byte=False))
    assert tok.max_chars_per_token == max(len(k) for k in tok.tok.get_vocab())
    for chars, n in tokens_per_text(tok):
        assert chars <= n * tok.max_chars_per_token


def test_no_bound_for_other_models_or_greedy_added_tokens():
    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert Tokenizer(wordpiece).max_chars_per_token is None
    tok = train_tokenizer()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # swallows the whitespace before it
    assert Tokenizer(tok).max_chars_per_token is None


def test_encode_gives_the_tokenizers_ids():
    hf = train_tokenizer()
    tok = Tokenizer(hf)
    for text in TEXTS + ["", "x"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids
