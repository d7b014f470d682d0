"""Uncertainty of acceptance measurements, so a verdict is never drawn from noise.

Counts are prefix counts (vLLM v1): per_position[i] = P(at least i+1 drafts accepted), measured
over `num_drafts` steps. The accepted count A of one step then has P(A >= m) = per_position[m-1],
so E[A^2] = sum_i (2i+1) * per_position[i], which gives the standard error of the mean acceptance
length without per-step records.
"""

from __future__ import annotations

import math
from typing import Sequence

Z = 1.96  # 95% intervals


def wilson(successes: float, n: float, z: float = Z) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) without data."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def acceptance_length_se(per_position: Sequence[float], num_drafts: float) -> float:
    """Standard error of the mean acceptance length (1 + mean accepted per step)."""
    if num_drafts <= 0:
        return math.inf
    mean = sum(per_position)
    second = sum((2 * i + 1) * p for i, p in enumerate(per_position))
    return math.sqrt(max(0.0, second - mean * mean) / num_drafts)


def differ(a: float, se_a: float, b: float, se_b: float, z: float = 3.0) -> bool:
    """Whether two independent estimates differ by more than z combined standard errors."""
    return abs(a - b) > z * math.sqrt(se_a * se_a + se_b * se_b)


def paired_difference(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], block: int) -> tuple[float, float]:
    """Mean of a - b over matched positions of matched sequences, and its standard error.

    Neighbouring positions share draft chains, so single positions are not independent: each
    sequence is cut into blocks of `block` positions and the blocks are treated as independent
    (batch means). Both estimates come from the same positions, so what the two share (which
    prompts, which text) cancels; a difference far smaller than either one's own noise shows."""
    sums, counts = [], []
    for xa, xb in zip(a, b):
        for i in range(0, len(xa), block):
            d = [p - q for p, q in zip(xa[i: i + block], xb[i: i + block])]
            if d:
                sums.append(sum(d))
                counts.append(len(d))
    n = sum(counts)
    if not n:
        return 0.0, math.inf
    mean = sum(sums) / n
    m = len(sums)
    if m < 2:
        return mean, math.inf
    var = sum((s - mean * c) ** 2 for s, c in zip(sums, counts)) * m / (m - 1)
    return mean, math.sqrt(var) / n


def mcnemar_z(better: int, worse: int) -> float:
    """McNemar's statistic for paired binary outcomes: of the items where exactly one of two
    measurements succeeded, `better` favour the first and `worse` the second. |z| > 3 is a change
    far beyond noise; items both got right or both got wrong carry no information about it."""
    n = better + worse
    return (better - worse) / math.sqrt(n) if n else 0.0
