"""`Session`: what every decoding loop shares for one sequence - the tokens so far, sampling, the stop rules
(EOS ids, stop strings, max new tokens, context limit) and the statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams
from .stats import GenerationStats


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens (an EOS that ended generation included)
    text: str | None  # decoded new tokens without the EOS that ended generation, cut before a stop string (None without
    # a tokenizer)
    finish_reason: str  # "eos", "stop" (a stop string) or "length" (max new tokens / context)
    stats: GenerationStats
    kinds: list[str] = field(default_factory=list)  # per new token, where it came from (see TOKEN_KINDS)


# Where a new token came from: the prefill forward's token, a plain decoding step, an accepted MTP draft, the
# backbone's own token at the first rejected draft, or the backbone's token after all k drafts were accepted.
TOKEN_KINDS = ("prefill", "plain", "draft", "correction", "bonus")


class Session:
    """State of one generation: tokens so far, sampling, stop rules, statistics."""

    def __init__(self, model, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                 eos_token_ids: list[int] | None, stop: list[str] | None, tokenizer=None):
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = model.context_length
        if len(prompt) >= limit:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {limit}")
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer (load the model from a folder with tokenizer.json)")
        self.model = model
        self.prompt_len = len(prompt)
        self.tokens = list(prompt)
        self.kinds: list[str] = []  # parallel to new_tokens: each one's kind (TOKEN_KINDS)
        self.max_new = min(max_new_tokens, limit - len(prompt))
        self.params = params
        self.eos = set(model.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.stop = [s for s in (stop or []) if s]
        self.tokenizer = tokenizer
        self.done = False
        self.finish_reason = "length"
        self.text: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        # Unseeded sampling draws from torch's global generator with the Leviathan acceptance rule. A seeded request
        # samples by the Gumbel-max trick with noise fixed per (seed, position) instead: the token at each position
        # is then a function of the seed alone, identical for plain decoding, any k and any batch (see `gumbel`).
        self._noise: dict[int, torch.Tensor] = {}  # position -> its noise, for the positions not yet emitted

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def text_tokens(self) -> list[int]:
        """The new tokens that are text: all but the EOS token that ended generation (the one place that drops it)."""
        new = self.new_tokens
        return new[:-1] if self.done and self.finish_reason == "eos" else new

    @property
    def plain_argmax(self) -> bool:
        """Greedy with no repetition penalty: the next token is the raw logits' argmax (the fast path)."""
        return self.params.greedy and self.params.repetition_penalty == 1.0

    @property
    def seeded(self) -> bool:
        """Sampling with a seed: Gumbel-max with per-position noise (deterministic under any k and any batch)."""
        return not self.params.greedy and self.params.seed is not None

    def gumbel(self, position: int, size: int) -> torch.Tensor:
        """The Gumbel noise [V] of one sequence position, fixed by (seed, position): argmax(log p + noise) is an exact
        sample from p, and a draft argmax(log q + noise) equals it often when q is close to p. Kept until the position
        is emitted: a round verifies positions the next one verifies again (~120 us each at V = 8k)."""
        noise = self._noise.get(position)
        if noise is None or noise.shape[0] != size:
            for p in [p for p in self._noise if p < len(self.tokens)]:
                del self._noise[p]
            g = torch.Generator().manual_seed((self.params.seed * 1_000_003 + position) % 2**63)
            u = torch.rand(size, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0)
            noise = self._noise[position] = (-(-u.log()).log()).float().to(self.model.device)
        return noise

    def emit(self, toks: list[int], kinds: list[str] | None = None) -> list[int]:
        """Append tokens, honouring EOS, stop strings and the length limit; returns those emitted. `kinds`: one
        of TOKEN_KINDS per token (default "plain"), kept in `self.kinds` for the tokens that stay."""
        if kinds is None:
            kinds = ["plain"] * len(toks)
        elif len(kinds) != len(toks):
            raise ValueError(f"emit got {len(toks)} tokens but {len(kinds)} kinds")
        out: list[int] = []
        for t, kind in zip(toks, kinds):
            if self.done:
                break
            self.tokens.append(t)
            self.kinds.append(kind)
            out.append(t)
            if t in self.eos:
                self.done, self.finish_reason = True, "eos"
            elif len(self.tokens) - self.prompt_len >= self.max_new:
                self.done, self.finish_reason = True, "length"
        if self.stop and out:
            out = self._apply_stop_strings(out)
        self.stats.new_tokens = len(self.tokens) - self.prompt_len
        return out

    def _apply_stop_strings(self, out: list[int]) -> list[int]:
        new = self.new_tokens
        text = self.tokenizer.decode(new)
        hits = [(text.find(s), s) for s in self.stop if s in text]
        if not hits:
            return out
        cut = min(i for i, _ in hits)
        # keep the shortest token prefix whose text reaches the stop string; drop the rest
        keep = len(new)
        for n in range(len(new) - len(out), len(new) + 1):
            if len(self.tokenizer.decode(new[:n])) > cut:
                keep = n
                break
        dropped = len(new) - keep
        del self.tokens[len(self.tokens) - dropped:]
        del self.kinds[len(self.kinds) - dropped:]
        self.done, self.finish_reason, self.text = True, "stop", text[:cut]
        return out[: len(out) - dropped]

    def result(self) -> GenerationResult:
        text = self.text
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(self.text_tokens)
        return GenerationResult(self.new_tokens, text, self.finish_reason, self.stats, list(self.kinds))
