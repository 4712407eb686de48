"""Statistics of one generation, defined once (the definitions: docs/architecture.md, "Statistics")."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    backbone_forwards: int = 0  # decode-time forwards (prefill not counted)
    prefill_forwards: int = 0
    prompt_cached: int = 0  # prompt tokens taken from the prompt cache (decode/prompt_cache.py), not read
    draft_tokens_max: int = 0  # the k in force (max for `auto`)
    drafted: list[int] = field(default_factory=list)  # per draft position j (0-based): drafts proposed
    accepted: list[int] = field(default_factory=list)  # per draft position j: drafts accepted
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_other: float = 0.0
    time_total: float = 0.0
    k_history: list[int] = field(default_factory=list)  # k used at each verify step
    n_history: list[int] = field(default_factory=list)  # drafts accepted at each verify step

    def record_step(self, k: int, n_accepted: int) -> None:
        """One verify step that offered k drafts and accepted the first n of them."""
        while len(self.drafted) < k:
            self.drafted.append(0)
            self.accepted.append(0)
        # Position j is offered only when drafts 0..j-1 were accepted: P(j accepted | before accepted).
        for j in range(min(k, n_accepted + 1)):
            self.drafted[j] += 1
        for j in range(n_accepted):
            self.accepted[j] += 1
        self.k_history.append(k)
        self.n_history.append(n_accepted)

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft j accepted | drafts before it accepted), j = 1..k."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per decode-time backbone forward, the bonus/correction token included.

        The first new token comes from the prefill forward and is not counted (plain decoding = 1.0)."""
        return (self.new_tokens - 1) / self.backbone_forwards if self.backbone_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.time_total if self.time_total else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "prompt_cached": self.prompt_cached,
            "new_tokens": self.new_tokens,
            "backbone_forwards": self.backbone_forwards,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "mean_accepted_length_note": "tokens emitted per backbone forward, bonus token included",
            "acceptance_per_position": [round(a, 4) for a in self.acceptance_per_position],
            "drafted_per_position": self.drafted,
            "accepted_per_position": self.accepted,
            "draft_tokens_max": self.draft_tokens_max,
            "time_s": {"prefill": round(self.time_prefill, 5), "draft": round(self.time_draft, 5),
                       "verify": round(self.time_verify, 5), "other": round(self.time_other, 5),
                       "total": round(self.time_total, 5)},
            "tokens_per_second": round(self.tokens_per_second, 3),
        }
