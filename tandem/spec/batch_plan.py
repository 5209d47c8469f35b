"""The batch plan: how many drafts each session of one verification step verifies.

Pure Python. SmartSpec's goodput rule over the whole step: drafts are taken best expected gain
first (each session's in its own order) and the step keeps the number of them that maximises
tokens per ms, where the ms are everything the drafts bring: the rows they add to the forward
(a compute-bound batch step grows with every row), and the wait for a draft worker's drafts,
which a session that drafts nothing does not make the step pay. Each subset of the batch's
methods is tried with the others' drafts off, so a method whose drafts lose is off for the
step while another's stay. Used by verify_service/policy/scheduler.py (Scheduler.plan).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence

_MIN_MS = 1e-3  # costs are divided by
MAX_GROUPS = 4  # methods tried in every subset; past this, all on or each alone


def plan_batch(gains: Sequence[Sequence[float]], cost: Callable[[int], float],
               entry: Sequence[float] | None = None,
               groups: Sequence[Hashable] | None = None) -> list[int]:
    """Drafts per session for one batch step. gains[i][j]: the expected tokens session i's
    (j+1)-th draft adds (parents first; its single-session k at most); cost(t): ms of a step
    over t tokens; entry[i]: ms the step pays once if session i verifies any draft (its share
    of the wait for its draft worker); groups[i]: its method. The plan maximises
    (B + the kept drafts' gains) / (cost(B + m) + the entries of the sessions that draft)."""
    b = len(gains)
    memo: dict[int, float] = {}

    def at(t: int) -> float:
        if t not in memo:
            memo[t] = max(_MIN_MS, cost(t))
        return memo[t]

    order = _merged(gains)
    entry = entry if entry is not None else [0.0] * b
    groups = groups if groups is not None else [0] * b
    best, best_on, best_m = b / at(b), None, 0
    for on in _subsets(groups):
        rate, m = _best_prefix(order, on, groups, entry, b, at)
        if rate > best * 1.001:  # prefer fewer drafts (and fewer methods) on near-ties
            best, best_on, best_m = rate, on, m
    counts = [0] * b
    if best_on is not None:
        for _, i in [(g, i) for g, i in order if groups[i] in best_on][:best_m]:
            counts[i] += 1
    return counts


def _merged(gains: Sequence[Sequence[float]]) -> list[tuple[float, int]]:
    """Every draft as (gain, session), best gain first, each session's drafts in order."""
    heap = [(-g[0], i) for i, g in enumerate(gains) if g]
    heapq.heapify(heap)
    taken, out = [0] * len(gains), []
    while heap:
        neg, i = heapq.heappop(heap)
        out.append((-neg, i))
        taken[i] += 1
        if taken[i] < len(gains[i]):
            heapq.heappush(heap, (-gains[i][taken[i]], i))
    return out


def _subsets(groups: Sequence[Hashable]) -> list[frozenset]:
    """The sets of methods whose drafts a step may verify: every non-empty subset of the
    batch's methods (few: a batch mixes a handful), smallest first."""
    keys = list(dict.fromkeys(groups))
    if len(keys) > MAX_GROUPS:
        return [frozenset(keys)] + [frozenset((k,)) for k in keys]
    return [frozenset(c) for n in range(1, len(keys) + 1)
            for c in itertools.combinations(keys, n)]


def _best_prefix(order, on: frozenset, groups, entry, b: int, at) -> tuple[float, int]:
    """(best tokens per ms, how many of `on`'s drafts in `order` give it) for one subset."""
    drafting = set()
    total, extra, worst, m = float(b), 0.0, at(b), 0
    best, best_m = 0.0, 0
    for gain, i in order:
        if groups[i] not in on:
            continue
        if i not in drafting:
            drafting.add(i)
            extra += entry[i]
        total, m = total + gain, m + 1
        worst = max(worst, at(b + m))  # more tokens never cost less
        rate = total / (worst + extra)
        if rate > best * 1.001:
            best, best_m = rate, m
    return best, best_m
