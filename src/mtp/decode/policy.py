"""How many tokens to draft per round: fixed k, or `auto` - one policy for one sequence and for a batch.

`auto` picks, before every round of B sequences, the k in [0, k_max] that maximises the tokens per second of the
batch,  sum over rows of E_s(k) / t_round(B, k),  E_s(k) = 1 + sum_{j=1..k} prod_{i<=j} a_{s,i},  from what this
decoder has measured: a_{s,i} = acceptance at draft position i of a round starting in state s - the row's last round
with drafts ended in a rejection, or with every draft accepted (`Acceptance`; counts pooled over the rows, with
exponential forgetting, so it follows the text: code accepts more than prose; carried from one generation of a model
to the next), t_round the measured time of a round at that batch size and k (carried alike). A generation is
a batch of one. Unseen deeper positions get an optimistic estimate (the last seen acceptance), and every 8th round
probes one draft more (and, offset, one fewer; less often while the probes keep confirming the best), so the policy
keeps learning. k = 0 (no drafts) wins where verifying
more tokens costs more than the drafts return, as for MoE models on memory-bound CPUs, where each extra verified
token reads up to top-k more experts (docs/decisions.md, "Qwen3.5-MoE").
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceCounts:
    """Drafts offered and accepted per draft position, decayed every round so the estimate follows the text."""

    forget: float = 0.97  # per-round decay of the counts
    prior: float = 2.0  # pseudo-counts of the starting guess
    start_acceptance: float = 0.7
    offered: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def record(self, rows: list[tuple[int, int]]) -> None:
        """One round: (drafts offered, drafts accepted) per sequence."""
        depth = max((k for k, _ in rows), default=0)
        while len(self.offered) < depth:
            self.offered.append(0.0)
            self.accepted.append(0.0)
        for j in range(len(self.offered)):
            self.offered[j] *= self.forget
            self.accepted[j] *= self.forget
        for k, n in rows:
            for j in range(min(k, n + 1)):  # position j is offered only when the drafts before it were accepted
                self.offered[j] += 1
            for j in range(n):
                self.accepted[j] += 1

    def acceptance(self, j: int) -> float:
        """Estimated P(draft j accepted | drafts before it accepted), j >= 1."""
        if j <= len(self.offered) and self.offered[j - 1] > 0:
            return (self.accepted[j - 1] + self.prior * self.start_acceptance) / (self.offered[j - 1] + self.prior)
        return self.acceptance(j - 1) if j > 1 else self.start_acceptance

    def expected_tokens_table(self, k_max: int) -> list[float]:
        """Expected tokens per verify with k drafts, the backbone's own token included, for k = 0..k_max."""
        table, run = [1.0], 1.0
        for j in range(1, k_max + 1):
            run *= self.acceptance(j)
            table.append(table[-1] + run)
        return table


# How a sequence's last round with drafts ended, the state its next round starts in: a draft rejected (or no round
# yet), or every draft it made accepted. Drafts are accepted far more often after a fully accepted round than after a
# rejection (int8 code-small, 7 bench prompts, first draft: 0.91-0.94 against 0.74-0.78 at k = 3, 4 and 5; each
# state's acceptances alike at every k), and the share of rounds after a full one falls as k grows (0.61, 0.55, 0.43),
# so acceptance pooled over both states fell with k (first draft 0.848, 0.839, 0.815): a pooled estimate measured
# around k = 4 over-rated k = 5, and `auto` ran at 0.93-0.96 of the best fixed k (docs/decisions.md, eighth session).
AFTER_REJECTION, AFTER_FULL = 0, 1


@dataclass
class Acceptance:
    """AcceptanceCounts kept apart by the state a round starts in (AFTER_REJECTION, AFTER_FULL)."""

    by_state: tuple[AcceptanceCounts, AcceptanceCounts] = field(
        default_factory=lambda: (AcceptanceCounts(), AcceptanceCounts()))

    def record(self, rows: list[tuple[int, int]], states: list[int]) -> None:
        """One round: (drafts offered, drafts accepted) per sequence, and the state each started in."""
        for state, counts in enumerate(self.by_state):
            mine = [row for row, s in zip(rows, states) if s == state]
            if mine:
                counts.record(mine)


# Round times kept per (B, k), and how they make the round's cost. Another process on the machine or a page fault
# adds time to a round, and a round that looks slow for k > 0 can hold k at 0, where probes are rare (seen here: a
# mean over rounds that met interference chose k = 0 at 0.7x the best k). But a round's own cost varies too: at k = 0
# every 8th round also lets the MTP read the positions it skipped (`round.catch_up`, ~1.6x a round), which a low
# quantile would leave out. So the estimate is the mean of the last WINDOW rounds, leaving out those past OUTLIER x
# their median.
WINDOW = 16
OUTLIER = 2.5
# A round time at (B, k) that was never measured is predicted (the fit over B and B*k, or the neighbours), and the
# prediction is linear where the machine is not: the bf16 tiles take 16 rows at a time, so at 8 rows a verify of 2
# tokens (16 rows) costs 4.8 ms, of 3 (24 rows) 7.6 ms and of 4 (32 rows) 9.6 ms (code-small, AMX Xeon). Probing
# only k +- 1 around the best, `auto` sat at k = 3 and never measured k = 1, the best by 14%. An unmeasured k within
# this factor of the best is tried once; its measured time then decides.
UNSEEN_BONUS = 1.1
# At most every 32nd round probes around a best k > 0 once the probes keep confirming it (8 rounds of 8 rows with
# k = 1 best lost ~7% to its two probes there, the k = 0 one with the MTP's catch-up after it; docs/decisions.md)
SETTLED_MAX = 2
# The most doublings of the wait between probes from k = 0 (every 256th round); a model whose probes have found k = 0
# best this many times in a row runs its generations of one sequence plain, all but every REST_PROBE-th (`rest`)
QUIET_MAX = 5
REST_PROBE = 8


def estimate(times: list[float]) -> float:
    """The mean of `times`, those over OUTLIER x their median left out."""
    median = sorted(times)[(len(times) - 1) // 2]
    kept = [t for t in times if t <= OUTLIER * median]
    return sum(kept) / len(kept)


@dataclass
class RoundTimes:
    """Round times per (B, k): the last WINDOW of each, and their `estimate` (kept with them, read every round)."""

    samples: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    estimates: dict[tuple[int, int], float] = field(default_factory=dict)
    # probes from k = 0 in a row that left it at 0 (each doubles the next wait, up to 32x): carried with the times, so
    # a generation where drafting has not paid before starts at the long wait instead of probing every 8, 16, 32, ...
    # rounds again (each probe from k = 0 makes the MTP read up to 9 positions; 0.81x MTP off in int4 before)
    quiet: int = 0
    # probes around a best k > 0 in a row that left it where it was (each doubles the next wait, up to SETTLED_MAX
    # doublings): a probe's round is one draft more or fewer than the best, lost throughput while the best holds
    settled: int = 0
    # generations of one sequence begun since the probes last settled on k = 0 for good (`rest`)
    rested: int = 0

    def rest(self) -> bool:
        """Whether a new `auto` generation of one sequence runs plain, the MTP left out: where QUIET_MAX probes in a
        row have found k = 0 best, the MTP's upkeep is all drafting still costs (its read of the prompt and of the
        positions skipped: fp32 `auto` ran at 0.94x plain on the shipped model, its rounds at k = 0 throughout;
        docs/decisions.md, 2026-12-06 sixth session). Every REST_PROBE-th such generation drafts again, to measure."""
        if self.quiet < QUIET_MAX:
            self.rested = 0
            return False
        self.rested += 1
        return self.rested % REST_PROBE != 0

    def record(self, key: tuple[int, int], seconds: float) -> None:
        recent = self.samples.setdefault(key, [])
        recent.append(seconds)
        del recent[:-WINDOW]
        self.estimates[key] = estimate(recent)


def solve(a: list[list[float]]) -> list[float] | None:
    """x with A x = y for the n rows [A_i..., y_i] of `a` (changed in place), by elimination with partial pivoting;
    None where A is singular at double precision (the points do not pin the fit down)."""
    n = len(a)
    scale = max(abs(v) for row in a for v in row[:n]) or 1.0
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) <= 1e-12 * scale:
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            for j in range(c, n + 1):
                a[r][j] -= f * a[c][j]
    x = [0.0] * n
    for c in reversed(range(n)):
        x[c] = (a[c][n] - sum(a[c][j] * x[j] for j in range(c + 1, n))) / a[c][c]
    return x


@dataclass
class DraftPolicy:
    """The draft length for a batch of B sequences decoded together (continuous batching): one k per round (each
    sequence drafts min(k, what it has left)), chosen to maximise tokens per second of the whole batch,
        sum over the B rows of E_s(k) / t_round(B, k)
    with E_s(k) from the acceptance pooled over the batch apart by the state s each row starts in (`Acceptance`,
    exponential forgetting) and t_round the measured time of a round at that batch size and k (a mean over the last
    rounds without outliers, `estimate`; unseen k interpolated from the ones seen at this B, or scaled from the
    nearest B). Verifying B(k+1) tokens costs more per token as the
    batch grows, so k falls with B, down to 0 (MTP off) where extra verified tokens stop paying. The second round
    measures k = 0 (the baseline), and so does the first round at a batch size not measured at k = 0 (or the first
    after them that does not follow a prompt chunk: `cold`, whose times are not learned from); every 8th round
    tries k+1 (from k = 0 too, the wait doubling up to every 256th round while the probes find k = 0 best) and every
    8th (offset) k-1 (the waits doubling up to every 32nd while the probes leave the best k > 0 where it is), to keep
    measuring; an unmeasured k predicted near the best is tried once (`UNSEEN_BONUS`)."""

    k_fixed: int | None  # None: auto; 0: MTP off
    k_max: int = 6
    counts: Acceptance = field(default_factory=Acceptance)  # pooled over the batch, apart by state
    rounds: RoundTimes = field(default_factory=RoundTimes)  # measured round times (shared: `from_arg`)
    k_last: int = 2
    probe_every: int = 8
    n: int = 0
    probed: int | None = None  # the last round was a probe around this best k
    # a lone row's rounds in a row for which `next_k`'s choice stands, its k after a rejection and after a fully accepted
    # round (`by_state`): the rounds up to the next probe (1 for a batch, a probe, a measuring or a cold round)
    run: int = 1
    by_state: tuple[int, int] = (0, 0)
    states: list[int] = field(default_factory=list)  # the state each decoding row's next round starts in, by row

    @property
    def times(self) -> dict[tuple[int, int], float]:
        """(B, k) -> estimated seconds of a round."""
        return self.rounds.estimates

    @classmethod
    def from_arg(cls, draft_tokens: int | str | None, limit: int, rounds: RoundTimes | None = None,
                 counts: Acceptance | None = None) -> DraftPolicy:
        """`rounds`: round times measured before (by earlier decoders of the same model and setup), shared and kept
        up to date: a round's cost is the model's and the machine's, not the text's, so a new generation starts
        from what the last one measured instead of exploring again. `counts`: the acceptance counts earlier decoders
        of the same model and drafter left, shared alike: a generation starts from the model's recent acceptance
        (forgetting then follows its text) instead of the prior, under which one rejected first draft had sent
        generations to k = 0 for 30-60 rounds (docs/decisions.md, 2026-12-03)."""
        if draft_tokens in (None, 0):
            return cls(0, k_max=0)
        if draft_tokens == "auto":
            return cls(None, k_max=min(6, limit), rounds=RoundTimes() if rounds is None else rounds,
                        counts=Acceptance() if counts is None else counts)
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= limit:
            raise ValueError(f"draft_tokens must be None, 0, an integer in 1..{limit} or 'auto', got {draft_tokens!r}")
        return cls(draft_tokens, k_max=draft_tokens)

    def fit(self) -> tuple[float, float, float] | None:
        """Least squares t = a + b*B + c*B*k over every (B, k) measured so far (a round verifies B(k+1) tokens and
        drafts B*k), so a batch size seen rarely borrows what the others measured; None until the points pin it down."""
        pts = list(self.times.items())
        if len({b for (b, _), _ in pts}) < 2 or len({k for (_, k), _ in pts}) < 2:
            return None
        # the normal equations, in Python floats: torch.linalg.lstsq's first call in a process set LAPACK up for ~10
        # ms, which a server's first round with two batch sizes paid, and each call after took ~37 us (this: ~15)
        n = sb = sc = sbb = sbc = scc = st = sbt = sct = 0.0
        for (b, k), t in pts:
            c = b * k
            n, sb, sc, sbb, sbc, scc = n + 1, sb + b, sc + c, sbb + b * b, sbc + b * c, scc + c * c
            st, sbt, sct = st + t, sbt + b * t, sct + c * t
        coef = solve([[n, sb, sc, st], [sb, sbb, sbc, sbt], [sc, sbc, scc, sct]])
        return None if coef is None or min(coef[1:]) < 0 else (coef[0], coef[1], coef[2])

    def round_time(self, batch: int, k: int, fit: tuple[float, float, float] | None = None) -> float | None:
        """Estimated seconds of a round of `batch` sequences drafting k: measured at (batch, k), else the linear fit
        over all measurements, else interpolated at this batch size or scaled from the nearest one."""
        if (batch, k) in self.times:
            return self.times[(batch, k)]
        if fit is not None:
            return max(1e-9, fit[0] + fit[1] * batch + fit[2] * batch * k)
        seen = sorted((kk, t) for (b, kk), t in self.times.items() if b == batch)
        if len(seen) >= 2:  # linear in k through the seen points (least squares)
            n = len(seen)
            mx, my = sum(x for x, _ in seen) / n, sum(y for _, y in seen) / n
            var = sum((x - mx) ** 2 for x, _ in seen)
            slope = max(0.0, sum((x - mx) * (y - my) for x, y in seen) / var)
            return max(1e-9, my + slope * (k - mx))
        if seen:
            k0, t0 = seen[0]
            return t0 * (1 + 0.15 * (k - k0))  # assume +15% per draft until a second k is seen at this batch size
        if not self.times:
            return None
        b0 = min({b for b, _ in self.times}, key=lambda b: abs(b - batch))
        t = self.round_time(b0, k)
        return None if t is None else t * batch / b0

    def next_k(self, batch: int, cold: bool = False, bucket: int | None = None, chain: bool = False) -> int:
        """k for the next round of a batch of `batch` sequences. `cold`: the round follows a prompt chunk, so its time
        is not learned from (`update`), and it neither measures k = 0 at a new batch size nor probes. `bucket`: the
        rows the round computes (`batch` where None), which its time is kept and predicted by: a round of 5 decoding
        rows computes the 8 of its bucket, as a round of 8 does (keyed by the 5, a drain's few rounds at 5-7 rows were
        measured apart, each estimate from a handful of rounds). `chain`: the caller may chain a lone row's rounds
        (`run`, `by_state`; left at 1 and unset otherwise)."""
        if self.k_fixed is not None:
            return self.k_fixed
        rows = batch if bucket is None else bucket
        self.n += 1
        self.run = 1
        fit = self.fit()
        tables = [c.expected_tokens_table(self.k_max) for c in self.counts.by_state]

        def best_for(full: int) -> int:  # `full` of the rows start after a fully accepted round, the others (new ones too) not
            best_k, best = self.k_last, -1.0
            for k in range(0, self.k_max + 1):
                t = self.round_time(rows, k, fit)
                if t is None:
                    break
                rate = ((batch - full) * tables[0][k] + full * tables[1][k]) / t
                if (rows, k) not in self.times:  # only predicted: worth one round to measure if it comes near the best
                    rate *= UNSEEN_BONUS
                if rate > best:
                    best_k, best = k, rate
            return best_k

        def stand(run: int) -> None:  # a lone row's chain: the k of either state stands for up to `run` rounds
            other = best_for(1 - full)
            self.by_state = (best_k, other) if full == 0 else (other, best_k)
            self.run = run

        full = sum(self.states[:batch])
        best_k = best_for(full)
        if self.probed is not None:  # the last round probed around self.probed: did it leave the best there?
            if self.probed == 0:  # wait longer before the next probe from 0 (up to 32x) ...
                self.rounds.quiet = min(self.rounds.quiet + 1, QUIET_MAX) if best_k == 0 else 0
            else:  # ... and around a k > 0 (up to 4x)
                self.rounds.settled = min(self.rounds.settled + 1, SETTLED_MAX) if best_k == self.probed else 0
        self.probed = None
        self.k_last = best_k
        if best_k > 0:  # drafting pays again: generations stop resting the MTP (`RoundTimes.rest`)
            self.rounds.quiet = min(self.rounds.quiet, QUIET_MAX - 1)
        if cold:
            if chain and batch == 1:  # cold rounds chain too (the caller ends the chain with them: no time is learned)
                stand(self.probe_every)
            return best_k
        if (self.n >= 2 or batch > 1) and (rows, 0) not in self.times:
            # measure a plain step early: the baseline drafting must beat; and at a batch size not seen yet, first: with
            # it the fit over B and B*k has two batch sizes, where before a new batch size borrowed the nearest one's
            # costs scaled by B, which keeps their ratio, and drafted at every size while a batch filled up (a round
            # with drafts costs 2-4x a plain one at 5-8 rows here, docs/decisions.md 2026-12-03 third session)
            return 0
        # probe one draft more every 8th round, and (offset) one fewer; from k = 0 too, then every 16th .. 256th while
        # probes keep finding k = 0 best (where drafting does not pay, a probe costs most: the MTP reads every position
        # it skipped); around a k > 0 every 16th, then 32nd while the probes leave the best where it is
        every = self.probe_every << (self.rounds.quiet if best_k == 0 else self.rounds.settled)
        if self.n % every == 0 and best_k < self.k_max:
            self.probed = best_k
            return best_k + 1
        if self.n % every == every // 2 and best_k > 0:
            self.probed = best_k
            return best_k - 1
        if chain and batch == 1:  # a lone row: the k of either state stands until the next probe
            after = lambda r: self.n - self.n % every + r + (every if r <= self.n % every else 0)  # noqa: E731
            probes = ([after(0)] if best_k < self.k_max else []) + ([after(every // 2)] if best_k > 0 else [])
            stand(min(probes, default=self.n + every) - self.n)
        return best_k

    def advance(self, rounds: int) -> None:
        """`rounds` more rounds ran within `next_k`'s `run` at `by_state`'s k (a chain of rounds in one call): counted
        as `next_k` counts the rounds it chooses for (their outcomes go to `update`, one round at a time)."""
        self.n += rounds

    def move_row(self, src: int, dst: int) -> None:
        """The sequence at row `src` goes on at row `dst` (the decoder keeps its rows contiguous): its state with it."""
        if dst < len(self.states):
            self.states[dst] = self.states[src] if src < len(self.states) else AFTER_REJECTION

    def reset_row(self, row: int) -> None:
        """A new sequence takes `row`: it starts as after a rejection (no round of its own yet)."""
        if row < len(self.states):
            self.states[row] = AFTER_REJECTION

    def update(self, batch: int, k: int, rows: list[tuple[int, int]], seconds: float | None,
               bucket: int | None = None) -> None:
        """After a round of `batch` sequences with draft length k: rows = (drafts made, accepted) per sequence;
        seconds None: the round's time says nothing about later rounds (it compiled a graph); `bucket`: as `next_k`'s.
        A fixed k (plain decoding too) records nothing: only `auto` reads what is recorded, and recording cost ~20 us
        a round, ~3% of a plain int4 step of the shipped model."""
        if self.k_fixed is not None:
            return
        states = self.states + [AFTER_REJECTION] * (len(rows) - len(self.states))
        self.counts.record(rows, states)
        # (a row that drafted nothing keeps its state: a plain step says nothing about how drafting goes)
        self.states = [s if offered == 0 else AFTER_FULL if n == offered else AFTER_REJECTION
                       for s, (offered, n) in zip(states, rows)]
        if seconds is None:
            return
        self.rounds.record((batch if bucket is None else bucket, k), seconds)
