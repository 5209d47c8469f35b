"""How many draft tokens a round verifies: Leviathan's expected gain over the measured cost.

Pure Python. With per-token acceptance a, a round verifying k draft tokens commits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens and costs one target forward over k + 1 tokens, whose
time we measure. The best k maximises E(k) / cost(k + 1). Drafting overlaps verification
(run-ahead), so its cost only shows up as drafts not having arrived yet, which caps k anyway.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.spec.batch_plan import plan_batch  # noqa: F401  (the batch plan: its own module)

# The cap on draft tokens per session per round (k), unless configured: a verifier's
# max_spec_tokens (the cost model picks each round's k up to it), a draft worker's (the most
# drafts a verifier may ask it for) and the gateway's (when no verifier reports one).
DEFAULT_MAX_SPEC_TOKENS = 16

# Forward time over q new tokens relative to q = 1, measured on the 2-core target machine
# (benchmarks/runner_speed.py). Only a fallback: a verifier times its own forwards per q at
# start-up (verify_service.policy.calibration.calibrate) and then every single-session round updates
# the curve.
DEFAULT_RELATIVE_COST = {1: 1.0, 2: 1.04, 3: 1.41, 4: 1.38, 5: 1.64, 6: 1.91, 7: 2.0, 8: 2.1,
                         9: 2.6, 12: 2.7, 16: 2.9}
_EMA = 0.2
# A proposer's per-session correction (update_source_scale): how fast old rounds fade, and
# how many expected tokens the starting scale counts as.
SCALE_DECAY = 0.1
SCALE_PRIOR_WEIGHT = 2.0
# A measured size not seen again within this many observations of any size is forgotten (back
# to its prior): one noisy episode must not price a size out for good, since a size priced
# out is never run, so never measured again.
STALE_AFTER = 256
_MIN_MS = 1e-3  # costs are divided by: a zero (or a clock that did not move) must not raise


def _valid(ms: float) -> bool:
    return math.isfinite(ms) and ms > 0


@dataclass
class _Recency:
    """When each measured size was last observed, counted in observations of any size."""

    seen: dict[int, int] = field(default_factory=dict)
    count: int = 0

    def touch(self, size: int) -> list[int]:
        """Record an observation of `size`; the sizes not observed for STALE_AFTER (now
        forgotten here, for the caller to forget too)."""
        self.count += 1
        self.seen[size] = self.count
        stale = [t for t, at in self.seen.items() if self.count - at > STALE_AFTER]
        for t in stale:
            del self.seen[t]
        return stale


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens committed per round with k drafts and per-token acceptance alpha."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s S = (1 - a^(k+1)) / ((1 - a)(k c + 1)), drafting serial."""
    return expected_tokens(alpha, k) / (k * c + 1.0)


@dataclass
class CostModel:
    """Measured round time (ms) by tokens verified per round (k + 1), single-session steps.

    A round's time is its forward, rejection and sampling; the wait for drafts is priced
    apart, by whoever sizes the round (choose_tree_size's draft_ms and gap_ms): it belongs to
    the draft's source, not to q tokens (an n-gram round of q waits for nothing).
    """

    ms: dict[int, float] = field(default_factory=dict)  # the start-up calibration, then EMAs
    _prior: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    _recency: _Recency = field(default_factory=_Recency, init=False, repr=False)
    # cost() until the next observation: ~250 calls a step at 4 sessions
    _table: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.ms = {q: max(_MIN_MS, v) for q, v in self.ms.items() if math.isfinite(v)}
        self._prior = dict(self.ms)

    def observe(self, num_tokens: int, elapsed_ms: float) -> None:
        if not _valid(elapsed_ms):
            return
        old = self.ms.get(num_tokens)
        self.ms[num_tokens] = elapsed_ms if old is None else (1 - _EMA) * old + _EMA * elapsed_ms
        self._table.clear()
        for q in self._recency.touch(num_tokens):  # sizes not run for long: back to the prior
            if q in self._prior:
                self.ms[q] = self._prior[q]
            else:
                self.ms.pop(q, None)

    def cost(self, num_tokens: int) -> float:
        """A round's ms over num_tokens: measured, or read off the measured sizes (start-up
        times 1-6, 8, 12 and 17) piecewise linearly; the built-in shape where none is."""
        c = self._table.get(num_tokens)
        if c is None:
            c = self.ms.get(num_tokens)
            if c is None:
                c = _at(_monotone(self.ms), num_tokens)
            self._table[num_tokens] = c
        return c


@dataclass
class StepCost:
    """What a verification step costs by the tokens it runs, every session of the batch
    together: the batch dimension of the cost model. The shape comes from start-up
    calibration (one sequence's forward over q tokens: the same GEMMs), the level from the
    decode steps measured as they run. Empty (no calibration): no batch plan, each session
    keeps its single-session k."""

    calibrated: dict[int, float] = field(default_factory=dict)
    observed: dict[int, float] = field(default_factory=dict)
    # What a step waits for draft workers' drafts, per whole batch asked (EMA of a step's
    # wait over the share of its sessions asked, `asked_share`, which the scheduler sets
    # before each step): a draft worker's session that drafts pays wait_ms / batch.
    wait_ms: float = 0.0
    asked_share: float = 0.0
    _recency: _Recency = field(default_factory=_Recency, init=False, repr=False)

    def __post_init__(self):
        self.calibrated = {q: max(_MIN_MS, v) for q, v in self.calibrated.items()
                           if math.isfinite(v)}

    @property
    def known(self) -> bool:
        return bool(self.calibrated)

    def observe(self, num_tokens: int, elapsed_ms: float, wait_ms: float | None = None) -> None:
        """A step's time over num_tokens; with wait_ms, elapsed_ms is its forward alone and
        the wait is learnt apart (it is paid by the sessions asked, not by every row)."""
        if wait_ms is not None and math.isfinite(wait_ms) and self.asked_share > 0:
            sample = max(0.0, wait_ms) / self.asked_share
            self.wait_ms = (1 - _EMA) * self.wait_ms + _EMA * sample if self.wait_ms else sample
        if not _valid(elapsed_ms):
            return
        old = self.observed.get(num_tokens)
        self.observed[num_tokens] = (elapsed_ms if old is None
                                     else (1 - _EMA) * old + _EMA * elapsed_ms)
        for t in self._recency.touch(num_tokens):  # not run for long: the calibrated shape
            del self.observed[t]

    def cost(self, num_tokens: int, anchor: int | None = None) -> float:
        """The calibrated curve at num_tokens, scaled by measured over calibrated at the
        measured step nearest `anchor` (default num_tokens). Anchored (a plan's sizes above
        its base step): the base's measured time plus the extra tokens at the steeper of the
        curve's scaled slope and the slope measured over the steps above the base, so one
        noisy sample never makes a token free, and what a batch's extra rows really cost
        (tree masks, heads) shows once such steps have run."""
        if anchor is not None:
            return self.above(anchor)(num_tokens)
        pts = _monotone(self.calibrated)
        if not self.observed:
            return _at(pts, num_tokens)
        near = min(self.observed, key=lambda t: (abs(t - num_tokens), t))
        return _at(pts, num_tokens) * self.observed[near] / _at(pts, near)

    def above(self, anchor: int) -> Callable[[int], float]:
        """cost(t, anchor) as a function of t: the curve's points, the measured step nearest
        the anchor and the slope above it read once, not per size (a batch plan prices up to
        a few dozen sizes a step: at 16 sessions, per size, ~1 ms of the event loop)."""
        pts = _monotone(self.calibrated)
        if not self.observed:
            return lambda t: _at(pts, t)
        near = min(self.observed, key=lambda t: (abs(t - anchor), t))
        base, at_near = self.observed[near], _at(pts, near)
        scale, measured = base / at_near, self._measured_slope(near)

        def cost(t: int) -> float:
            prior = _at(pts, t)
            if t <= near:
                return prior * scale
            return base + max(scale * (prior - at_near) / (t - near), measured) * (t - near)
        return cost

    def _measured_slope(self, base: int) -> float:
        """Least-squares ms per token over the measured steps from base to twice its size
        (0 when fewer than three sizes were seen there)."""
        pts = [(t, ms) for t, ms in self.observed.items() if base <= t <= 2 * base + 8]
        if len(pts) < 3:
            return 0.0
        mt = sum(t for t, _ in pts) / len(pts)
        mc = sum(ms for _, ms in pts) / len(pts)
        var = sum((t - mt) ** 2 for t, _ in pts)
        return max(0.0, sum((t - mt) * (ms - mc) for t, ms in pts) / var)


def _monotone(curve: dict[int, float]) -> list[tuple[int, float]]:
    """The curve's points by size, each at least the one before (more tokens never cost
    less, calibration noise aside); the default shape where there are none."""
    pts = sorted(curve.items()) or [(q, 30.0 * c) for q, c in DEFAULT_RELATIVE_COST.items()]
    for i in range(1, len(pts)):
        pts[i] = (pts[i][0], max(pts[i][1], pts[i - 1][1]))
    return pts


def _at(pts: list[tuple[int, float]], q: int) -> float:
    """The curve (its _monotone points) at q: piecewise linear through the points, flat below
    the first, extended with the last segment's slope beyond the last (a compute-bound
    forward grows linearly)."""
    if q <= pts[0][0]:
        return pts[0][1]
    if len(pts) == 1:
        return pts[0][1] * q / pts[0][0]
    for (q0, c0), (q1, c1) in zip(pts, pts[1:]):
        if q <= q1:
            return c0 + (c1 - c0) * (q - q0) / (q1 - q0)
    (q0, c0), (q1, c1) = pts[-2], pts[-1]
    return c1 + max(0.0, (c1 - c0) / (q1 - q0)) * (q - q1)


def choose_k(alpha: float, k_allowed: int, cost: CostModel) -> int:
    """argmax_k E(k) / cost(k + 1) over 0..k_allowed (0 = plain decode)."""
    best_k, best = 0, expected_tokens(alpha, 0) / cost.cost(1)
    for k in range(1, k_allowed + 1):
        rate = expected_tokens(alpha, k) / cost.cost(k + 1)
        if rate > best * 1.001:  # prefer the shorter round on near-ties
            best_k, best = k, rate
    return best_k


def choose_tree_size(reach: list[float] | tuple[float, ...], n_max: int,
                     cost: CostModel, draft_ms: float = 0.0, gap_ms: float = 0.0) -> int:
    """How many nodes of a tree to verify: argmax_n (1 + sum(reach[:n])) / cost(n + 1) over
    0..n_max, where reach[i] estimates the chance node i (parents first) is accepted;
    draft_ms is what a round with any nodes also waits for them (a tree drafted after the
    last commit), which plain decoding (n = 0) does not, and gap_ms what it waits per node
    after the first (a chain a draft worker drafts one token at a time)."""
    return _best_size(reach, n_max, cost, draft_ms, gap_ms)[0]


def best_rate(reach: list[float] | tuple[float, ...], n_max: int, cost: CostModel) -> float:
    """Expected tokens per ms of a proposal with these per-node reaches, verified at its best
    size (choose_tree_size): how `auto` compares proposals from different proposers."""
    return _best_size(reach, n_max, cost, 0.0, 0.0)[1]


def _best_size(reach, n_max: int, cost: CostModel, draft_ms: float,
               gap_ms: float) -> tuple[int, float]:
    best_n, best, gain = 0, 1.0 / cost.cost(1), 1.0
    for n in range(1, min(n_max, len(reach)) + 1):
        gain += reach[n - 1]
        rate = gain / (cost.cost(n + 1) + draft_ms + (n - 1) * gap_ms)
        if rate > best * 1.001:  # prefer the smaller round on near-ties
            best_n, best = n, rate
    return best_n, best


def update_tree_scale(scale: float, expected: float, accepted: int) -> float:
    """A session's correction to the tree's reach estimates: accepted over expected, smoothed
    (and bounded, so one lucky or unlucky round cannot switch the tree off or blow it up)."""
    if expected <= 0:
        return scale
    sample = scale * accepted / expected
    return _bounded((1 - _EMA) * scale + _EMA * sample)


def update_source_scale(evidence: tuple[float, float] | None, scale: float, expected: float,
                        accepted: int) -> tuple[tuple[float, float], float]:
    """A proposer's correction in one session (accepted / expected of its drafts) as a ratio of
    decayed sums, not an EMA of per-round ratios: a round that expected 0.04 tokens (a
    one-token n-gram match on chat, at a low scale) and got 2 weighs 0.04 tokens of evidence
    rather than multiplying the scale by 50, which kept chat drafting at a loss. evidence:
    (accepted, expected) so far, None at the session's first round (then `scale`, its prior,
    counts as SCALE_PRIOR_WEIGHT expected tokens); expected: this round's drafts' unscaled
    reach. Returns the new evidence and scale (bounded as update_tree_scale's)."""
    acc, exp = evidence if evidence is not None else (SCALE_PRIOR_WEIGHT * scale,
                                                      SCALE_PRIOR_WEIGHT)
    acc = (1 - SCALE_DECAY) * acc + accepted
    exp = (1 - SCALE_DECAY) * exp + max(0.0, expected)
    return (acc, exp), _bounded(acc / exp) if exp > 0 else scale


def _bounded(scale: float) -> float:
    """A correction kept within [0.05, 4]: one lucky or unlucky stretch cannot switch a
    proposer off for good or blow its estimates up."""
    return min(4.0, max(0.05, scale))


def update_acceptance(ema: float, drafted: int, accepted: int) -> float:
    """Per-token acceptance estimate: accepted / (accepted + rejections), smoothed."""
    if drafted == 0:
        return ema
    rejected = 1 if accepted < drafted else 0
    sample = accepted / (accepted + rejected) if accepted + rejected else ema
    return (1 - _EMA) * ema + _EMA * sample
