"""Streaming text deltas (mtp.serve.textstream): no half characters, no stop-string prefixes, and the
deltas always add up to the final text."""

from __future__ import annotations

import pytest

from conftest import tiny_model
from mtp.decode.sampling import SamplingParams
from mtp.decode.session import Session
from mtp.io import Tokenizer
from mtp.serve.textstream import TextStream, stop_holdback
from serve_support import EOS, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


def decode_fn(tok):
    return lambda ids: tok.decode(list(ids), skip_special_tokens=False)


def stream_deltas(tok, text: str, stop: list[str] | None) -> tuple[list[str], list[int]]:
    """Push the tokens of `text` one at a time, as a decoder emitting them would."""
    ids = tok.encode(text).ids
    ts = TextStream(decode_fn(tok), stop)
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
    ts = TextStream(decode_fn(tok), ["print(", "range(99"])
    sent, held_range = "", False
    for n in range(len(ids)):
        sent += ts.push(ids[: n + 1])
        assert final.startswith(sent), f"leaked text after the stop: {sent!r}"
        held_range |= tok.decode(ids[: n + 1]).endswith("range(") and not sent.endswith("range(")
    assert held_range, '"range(" was held back while it could still become "range(99"'
    assert sent == final  # released once it could no longer be the stop string
    assert ts.finish(final) == ""


def test_the_eos_that_ends_generation_is_not_text(tok):
    """Session.text_tokens is the one place that drops it: GenerationResult.text (mtp generate, the Python API, the
    server's whole answers) and the server's streamed deltas all read it."""
    eos = tok.token_to_id(EOS)
    model = tiny_model(vocab_size=tok.get_vocab_size(), eos_token_id=eos)
    ids = tok.encode("def add(a, b):").ids
    session = Session(model, [1], 10, SamplingParams(), None, None, Tokenizer(tok))
    ts = TextStream(decode_fn(tok), ["zz"])
    shown = ""
    for t in ids:
        session.emit([t])
        assert session.text_tokens == session.new_tokens  # not done: every token is text
        shown += ts.push(session.text_tokens)
    session.emit([eos, ids[0]])  # the EOS ends generation: nothing after it is emitted
    assert session.done and session.new_tokens == ids + [eos] and session.text_tokens == ids
    result = session.result()
    assert result.text == "def add(a, b):" and result.finish_reason == "eos" and result.tokens[-1] == eos
    shown += ts.push(session.text_tokens)
    assert EOS not in shown and shown + ts.finish(result.text) == result.text
    # without an EOS rule (ignore_eos) the EOS token is text like any other
    session = Session(model, [1], 10, SamplingParams(), [], None, Tokenizer(tok))
    session.emit(ids[:2] + [eos])
    assert not session.done and session.result().text == tok.decode(ids[:2] + [eos], skip_special_tokens=False)


def test_trailing_stop_prefix_is_released_at_the_end(tok):
    ts = TextStream(decode_fn(tok), ["b):X"])
    ids = tok.encode("def add(a, b):").ids
    shown = "".join(ts.push(ids[: n + 1]) for n in range(len(ids)))
    assert shown == "def add(a, "  # "b):" could still become the stop string
    assert ts.finish("def add(a, b):") == "b):"
