"""Pearson's chi-square goodness of fit, for the distribution tests (no scipy here)."""
from __future__ import annotations

import math

# Chi-square's 0.1% critical values by degrees of freedom (tables); beyond, Wilson-Hilferty.
_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12,
         9: 27.88, 10: 29.59}


def critical(dof: int) -> float:
    """The 0.1% critical value (Wilson-Hilferty within 1% of the tables from 3 degrees)."""
    if dof in _CRIT:
        return _CRIT[dof]
    z = 3.09  # the normal's 99.9% point
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def pearson(counts: dict[int, int], expected: dict[int, float]) -> tuple[float, int]:
    """(statistic, degrees of freedom); outcomes expected fewer than 5 times are pooled."""
    n = sum(counts.values())
    big = [t for t, p in expected.items() if p * n >= 5]
    obs = [counts.get(t, 0) for t in big] + [n - sum(counts.get(t, 0) for t in big)]
    exp = [expected[t] * n for t in big] + [n * (1 - sum(expected[t] for t in big))]
    if exp[-1] < 1:
        obs, exp = obs[:-1], exp[:-1]
    return sum((o - e) ** 2 / e for o, e in zip(obs, exp)), max(1, len(obs) - 1)


def chi_square(counts: dict[int, int], expected: dict[int, float]) -> tuple[float, float]:
    """(Pearson's statistic, its 0.1% critical value)."""
    stat, dof = pearson(counts, expected)
    return stat, critical(dof)
