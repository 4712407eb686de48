"""Turning a growing list of token ids into safe text deltas for streaming.

Each step decodes the whole list of text tokens (`Session.text_tokens`: the EOS that ends generation is not text)
and emits only the new suffix, holding back
- a trailing U+FFFD: the first bytes of a multi-byte character whose remaining bytes are still to come;
- text that could be the start of a stop string, until the next tokens show whether it is one.
At the end, `finish` releases whatever the final (stop-cut) text still holds.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT_CHAR = "\ufffd"


def stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class TextStream:
    """`push(new_tokens) -> delta` after each step, `finish(final_text) -> delta` once at the end."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | None):
        self.decode = decode
        self.stop = stop or []
        self.sent = ""

    def safe_text(self, tokens: list[int]) -> str:
        """The decoded text that can be shown now without ever having to take it back."""
        text = self.decode(tokens).rstrip(REPLACEMENT_CHAR)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            return text[: min(cuts)]
        return text[: len(text) - stop_holdback(text, self.stop)]

    def _delta_to(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new, or decoding is not prefix-stable here: wait for more tokens
        delta, self.sent = text[len(self.sent):], text
        return delta

    def push(self, tokens: list[int]) -> str:
        """The new text since the last call, given all text tokens so far."""
        return self._delta_to(self.safe_text(tokens))

    def finish(self, final_text: str) -> str:
        """The rest of the final text (`GenerationResult.text`: cut before a stop string)."""
        return self._delta_to(final_text)

