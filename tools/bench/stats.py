"""The arithmetic of `tandem bench`: pure Python (no torch), so it is unit-tested on synthetic
results and the report can be re-rendered from a JSON file alone.

Definitions used throughout (the report's footnotes repeat them):
- decode tokens/s = (n - 1) / (t_last_token - t_first_token): vLLM's 1 / TPOT, the same for a
  streamed HTTP response and for transformers' streamer, so prefill never enters a ratio;
- per-token acceptance a = accepted / (accepted + rejections): the maximum-likelihood estimate
  of Leviathan's a under his i.i.d. model when rounds stop at k (accepted / drafted would count
  drafts that were never at risk of rejection as failures);
- per-position rate i = P(draft i accepted | drafts 1..i-1 accepted and draft i was verified).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from tandem.spec.cost import leviathan_speedup

# RoundRow: (drafted, accepted, bonus, draft_wait_ms, verify_ms, rejection_ms, gap_ms, committed);
# gap_ms is the client-observed time since the previous round's message (None for the first
# round, whose gap is the prefill); committed is the number of tokens the round's message held.
RoundRow = Sequence


def percentile(values: Iterable[float], q: float, method: str = "linear") -> float:
    """The q-th percentile of `values`; NaN for no values. "linear" interpolates between the
    two nearest ranks (numpy's default method); "exclusive" is statistics.quantiles' default
    (n=100), for a whole q in 1..99, a single value being every percentile of itself."""
    xs = sorted(values)
    if not xs:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if method == "exclusive":
        if q != int(q) or not 1 <= q <= 99:
            raise ValueError(f"an exclusive percentile needs a whole q in [1, 99], got {q}")
        return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else xs[0]
    if method != "linear":
        raise ValueError(f"method must be 'linear' or 'exclusive', got {method!r}")
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def decode_tps(num_tokens: int, t_first: float, t_last: float) -> float:
    """Tokens per second from first token to last; NaN when it cannot be measured."""
    if num_tokens < 2 or t_last <= t_first:
        return math.nan
    return (num_tokens - 1) / (t_last - t_first)


def throughput(runs: Iterable[dict]) -> float:
    """Aggregate decode tokens/s of several runs: total tokens over total time, so a long run
    weighs more than a short one (a mean of rates would not)."""
    n = t = 0.0
    for r in runs:
        if r.get("decode_tps") and not math.isnan(r["decode_tps"]):
            n += r["tokens"] - 1
            t += (r["tokens"] - 1) / r["decode_tps"]
    return n / t if t else math.nan


def per_position_rates(rounds: Iterable[RoundRow], k: int) -> list[float]:
    """Conditional acceptance of draft position 1..k; NaN where no round reached it."""
    hits, reached = [0] * k, [0] * k
    for row in rounds:
        drafted, accepted = int(row[0]), int(row[1])
        for i in range(min(drafted, k)):
            if accepted >= i:  # drafts before position i+1 were all accepted
                reached[i] += 1
                hits[i] += accepted > i
    return [h / r if r else math.nan for h, r in zip(hits, reached)]


def acceptance_alpha(rounds: Iterable[RoundRow]) -> float:
    """accepted / (accepted + rejections) over rounds that drafted anything."""
    accepted = rejections = 0
    for row in rounds:
        if int(row[0]) > 0:
            accepted += int(row[1])
            rejections += int(row[1]) < int(row[0])
    total = accepted + rejections
    return accepted / total if total else math.nan


def spec_summary(rounds: Sequence[RoundRow], k: int) -> dict:
    """Acceptance figures of one configuration from its verifier rounds."""
    spec = [r for r in rounds if int(r[0]) > 0]
    drafted = sum(int(r[0]) for r in spec)
    accepted = sum(int(r[1]) for r in spec)
    committed = sum(int(r[7]) for r in rounds)
    return {"rounds": len(rounds), "spec_rounds": len(spec),
            "mean_k": drafted / len(spec) if spec else 0.0,
            "acceptance_rate": accepted / drafted if drafted else math.nan,
            "alpha": acceptance_alpha(rounds),
            "per_position": per_position_rates(rounds, k),
            "mean_accepted_length": committed / len(rounds) if rounds else math.nan}


def leviathan_bound(alpha: float, k: float, c: float) -> float:
    """S = (1 - a^(k+1)) / ((1 - a)(k c + 1)); k may be a mean (the verifier adapts it)."""
    if math.isnan(alpha) or c is None or math.isnan(c):
        return math.nan
    if k <= 0:
        return 1.0
    if float(k).is_integer():
        return leviathan_speedup(min(alpha, 1.0), int(k), c)
    a = min(alpha, 1.0 - 1e-12)  # the closed form, valid for a fractional k too
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + 1))


def best_bound(alpha: float, k_allowed: int, c: float) -> tuple[int, float]:
    """The best k <= k_allowed for Leviathan's formula and its S (what k could have bought)."""
    options = [(k, leviathan_bound(alpha, k, c)) for k in range(1, k_allowed + 1)]
    options = [o for o in options if not math.isnan(o[1])]
    return max(options, key=lambda o: o[1]) if options else (0, math.nan)


def round_breakdown(rounds: Iterable[RoundRow]) -> dict:
    """Mean ms per round: drafting wait, verify forward, rejection sampling, and the rest of the
    client-observed gap (network, serialization, scheduling). The first round is left out: its
    gap is the prefill."""
    rows = [r for r in rounds if r[6] is not None]
    if not rows:
        return {}
    mean = {name: sum(float(r[i]) for r in rows) / len(rows)
            for i, name in ((3, "draft_wait_ms"), (4, "verify_ms"), (5, "rejection_ms"),
                            (6, "gap_ms"))}
    mean["other_ms"] = mean["gap_ms"] - mean["draft_wait_ms"] - mean["verify_ms"] - \
        mean["rejection_ms"]
    mean["rounds"] = len(rows)
    return mean


def breakdown_by_k(rounds: Iterable[RoundRow]) -> dict[int, dict]:
    """round_breakdown per number of drafts verified (k), with tokens committed per round:
    where each k's milliseconds go, against what it commits."""
    by_k: dict[int, list] = {}
    for r in rounds:
        if r[6] is not None:
            by_k.setdefault(int(r[0]), []).append(r)
    out = {}
    for k, rows in sorted(by_k.items()):
        b = round_breakdown(rows)
        b["tokens_per_round"] = sum(float(r[7]) for r in rows) / len(rows)
        out[k] = b
    return out


def itl_samples(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Per-token inter-token latencies (s): the gap before a chunk is spread evenly over its
    tokens, so a round that commits 4 tokens at once counts as 4 short latencies."""
    out = []
    for i in range(1, len(chunk_times)):
        n = max(1, int(chunk_tokens[i]))
        out += [(chunk_times[i] - chunk_times[i - 1]) / n] * n
    return out


def ratio(num: float, den: float) -> float:
    if den is None or num is None or den == 0 or math.isnan(den) or math.isnan(num):
        return math.nan
    return num / den
