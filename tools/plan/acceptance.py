"""Acceptance from recorded rounds: per method (and workload), the chance each draft position
is accepted given the ones before it were, and how often the method proposes at all. Built
from the gateway's `speculation_round` SSE events ({"drafted", "accepted", ...}: one per round,
docs/reference/api.md), not one mean alpha: position i's rate is the rounds that accepted
>= i over those that drafted >= i and accepted >= i - 1 (a survival estimate).
"""
from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_POSITIONS = 16  # the verifier's DEFAULT_MAX_SPEC_TOKENS


@dataclass(frozen=True)
class MethodAcceptance:
    """position_rates[i]: P(draft i + 1 accepted | drafts 1..i accepted); past the end the
    last rate repeats. propose_rate: the share of rounds whose method had drafts to offer
    (history methods without a match offer none); rounds: the evidence behind it."""

    position_rates: tuple[float, ...]
    propose_rate: float = 1.0
    rounds: int = 0
    histogram: dict[str, dict[str, int]] = field(default_factory=dict)  # drafted -> accepted

    def __post_init__(self):
        object.__setattr__(self, "position_rates", tuple(float(r) for r in self.position_rates))
        if not self.position_rates or not all(0 <= r <= 1 for r in self.position_rates):
            raise ValueError(f"position_rates must be non-empty, each in [0, 1], got "
                             f"{self.position_rates}")
        if not 0 <= self.propose_rate <= 1:
            raise ValueError(f"propose_rate must be in [0, 1], got {self.propose_rate}")

    def rate(self, position: int) -> float:
        """P(accepted) of draft `position` (0-based) given the earlier ones were."""
        return self.position_rates[min(position, len(self.position_rates) - 1)]

    def reach(self, k: int) -> list[float]:
        """Chance each of the first k drafts is accepted (cumulative products)."""
        out, p = [], 1.0
        for i in range(k):
            p *= self.rate(i)
            out.append(p)
        return out

    def sample(self, k: int, rng: random.Random) -> int:
        """Accepted drafts of a round verifying k."""
        for i in range(k):
            if rng.random() >= self.rate(i):
                return i
        return k

    def mean_length(self, k: int) -> float:
        """Expected tokens committed by a round of k drafts (accepted + the bonus/recovered)."""
        return 1.0 + sum(self.reach(k))


def constant(alpha: float, propose_rate: float = 1.0) -> MethodAcceptance:
    return MethodAcceptance((alpha,), propose_rate)


def from_rounds(rounds: Iterable[tuple[int, int]]) -> MethodAcceptance:
    """Survival estimate from (drafted, accepted) pairs of recorded rounds."""
    rounds = list(rounds)
    if not rounds:
        raise ValueError("no recorded rounds to estimate acceptance from")
    hist: dict[str, dict[str, int]] = {}
    for d, a in rounds:
        if not 0 <= a <= d:
            raise ValueError(f"a round accepted {a} of {d} drafts")
        row = hist.setdefault(str(d), {})
        row[str(a)] = row.get(str(a), 0) + 1
    drafted = [(d, a) for d, a in rounds if d > 0]
    rates = []
    for i in range(1, MAX_POSITIONS + 1):
        tried = sum(1 for d, a in drafted if d >= i and a >= i - 1)
        if tried < 3:  # too little evidence this deep: the last rate repeats
            break
        rates.append(sum(1 for d, a in drafted if d >= i and a >= i) / tried)
    return MethodAcceptance(tuple(rates) or (0.0,), len(drafted) / len(rounds), len(rounds),
                            hist)


def decode_rounds(rows: Iterable[dict]) -> list[dict]:
    """Recorded rounds without each request's first ("round": 1): that round runs the prompt's
    prefill and has nothing to verify under any method, and the simulation never offers drafts
    there either, so counting it would lower the propose rate of the rounds that can draft
    (one round per request: one in six of suffix's rounds at c=4 on 2026-11-28)."""
    return [r for r in rows if r.get("round", 0) != 1]


# Used when no recorded rounds are given: measured on this host's shipped pair with
# temperature 0 chat prompts (docs/results/plan-validate-2026-11-28.md records the run that
# replaces them); EAGLE-3 and a 1B draft for Llama-3.1-8B from the EAGLE-3 paper's MT-bench
# acceptance lengths (~6.1 at k = 7, chain ~ 0.85 per token) and a typical 1B draft (~0.7).
DEFAULTS: dict[str, MethodAcceptance] = {
    "none": constant(0.0, 0.0),
    "ngram": MethodAcceptance((0.55, 0.6, 0.65), 0.45),
    "suffix": MethodAcceptance((0.6, 0.65, 0.7), 0.55),
    "draft_model": MethodAcceptance((0.75, 0.72, 0.7)),
    "eagle": MethodAcceptance((0.85, 0.85, 0.84, 0.83)),
    "medusa": MethodAcceptance((0.6, 0.5, 0.45)),
}


def table_from_json(raw: dict) -> dict[str, MethodAcceptance]:
    return {m: MethodAcceptance(tuple(v["position_rates"]), v.get("propose_rate", 1.0),
                                v.get("rounds", 0), v.get("histogram", {}))
            for m, v in raw.items()}


def table_to_json(table: dict[str, MethodAcceptance]) -> dict:
    return {m: {"position_rates": list(a.position_rates), "propose_rate": a.propose_rate,
                "rounds": a.rounds, "histogram": a.histogram} for m, a in table.items()}
