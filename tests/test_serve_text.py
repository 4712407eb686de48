"""Streaming text deltas (mtp.serve.textstream): no half characters, no stop-string prefixes, and the
deltas always add up to the final text."""

from __future__ import annotations

import pytest

from mtp.serve.textstream import TextStream, final_text, stop_holdback
from serve_support import EOS, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def decode_fn(tok):
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


def stream_deltas(tok, text: str, stop: list[str] | None, eos: set[int] = frozenset()) -> tuple[list[str], list[int]]:
    """Push the tokens of `text` one at a time, as a decoder emitting them would."""
    ids = tok.encode(text).ids
    ts = TextStream(decode_fn(tok), stop, set(eos))
    return [ts.push(ids[: n + 1]) for n in range(len(ids))], ids


def test_stop_holdback():
    assert stop_holdback("abc", ["cde"]) == 1
    assert stop_holdback("abcd", ["cdx", "bcdy"]) == 3
    assert stop_holdback("abc", ["xyz"]) == 0
    assert stop_holdback("abc", ["abc"]) == 0  # the whole stop string is not a prefix to hold: it is a hit
    assert stop_holdback("", ["a"]) == 0


def test_multibyte_characters_are_never_split(tok):
    text = "Héllo wörld ✓ 日本語 naïve"
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode(ids[:n]) for n in range(1, len(ids))), "the test needs a split character"
    deltas, _ = stream_deltas(tok, text, None)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_prefix_is_held_back_and_never_leaked(tok):
    text = "for i in range(10):\n    print(i * i)\n"
    final = "for i in range(10):\n    "
    ids = tok.encode(text).ids
    ts = TextStream(decode_fn(tok), ["print(", "range(99"], set())
    sent, held_range = "", False
    for n in range(len(ids)):
        sent += ts.push(ids[: n + 1])
        assert final.startswith(sent), f"leaked text after the stop: {sent!r}"
        held_range |= tok.decode(ids[: n + 1]).endswith("range(") and not sent.endswith("range(")
    assert held_range, '"range(" was held back while it could still become "range(99"'
    assert sent == final  # released once it could no longer be the stop string
    assert ts.finish(final) == ""


def test_eos_is_not_text_and_finish_releases_the_rest(tok):
    eos = tok.token_to_id(EOS)
    ids = tok.encode("def add(a, b):").ids + [eos]
    ts = TextStream(decode_fn(tok), ["zz"], {eos})
    shown = "".join(ts.push(ids[: n + 1]) for n in range(len(ids)))
    final = final_text(decode_fn(tok), ids, "eos", None, {eos})
    assert final == "def add(a, b):" and EOS not in shown
    assert shown + ts.finish(final) == final


def test_trailing_stop_prefix_is_released_at_the_end(tok):
    ts = TextStream(decode_fn(tok), ["b):X"], set())
    ids = tok.encode("def add(a, b):").ids
    shown = "".join(ts.push(ids[: n + 1]) for n in range(len(ids)))
    assert shown == "def add(a, "  # "b):" could still become the stop string
    assert ts.finish("def add(a, b):") == "b):"
