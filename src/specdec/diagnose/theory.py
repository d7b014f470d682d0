"""What an acceptance curve is worth: expected tokens per target pass, speedup, and the best k.

Everything here works on the *unconditional* per-position curve p, where p[i] is the probability
that a draft had at least i+1 tokens accepted (vLLM: accepted_tokens_per_pos[i] / num_drafts).
A chain of k drafts then commits E(k) = 1 + sum(p[:k]) tokens per target pass (the 1 is the
target's own bonus token). If drafting one token costs c target passes, one speculative step
costs 1 + k*c and the speedup over plain decoding is S = E / (1 + k*c); speculation pays only
when E > 1 + k*c.

With i.i.d. acceptance a, p[i] = a^(i+1) and E = (1 - a^(k+1)) / (1 - a).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DEFAULT_COST_RATIO = 0.05  # EAGLE-3 head vs an 8B target at batch 1: one small layer + lm_head
DEFAULT_K_MAX = 10


@dataclass(kw_only=True, frozen=True)
class KPoint:
    k: int
    expected_tokens: float
    speedup: float

    def as_dict(self) -> dict:
        return {"k": self.k, "expected_tokens": self.expected_tokens, "speedup": self.speedup}


def expected_tokens_iid(a: float, k: int) -> float:
    """Expected tokens per target pass for a chain of k drafts with i.i.d. acceptance a."""
    if k <= 0:
        return 1.0
    if abs(1.0 - a) < 1e-12:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def iid_curve(a: float, k: int) -> list[float]:
    """Unconditional per-position curve of i.i.d. acceptance a: P(at least i+1 accepted) = a^(i+1)."""
    return [a ** (i + 1) for i in range(k)]


def fit_iid_rate(mean_accepted: float, k: int) -> float:
    """The i.i.d. acceptance a whose chain of k drafts accepts `mean_accepted` tokens on average.

    Solves a + a^2 + ... + a^k = mean_accepted by bisection (the left side grows with a).
    """
    if k <= 0 or mean_accepted <= 0:
        return 0.0
    if mean_accepted >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(mid ** (i + 1) for i in range(k)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def conditional_rates(curve: Sequence[float]) -> list[float | None]:
    """P(position i accepted | position i-1 accepted); position 0 is unconditional."""
    out: list[float | None] = []
    prev = 1.0
    for p in curve:
        out.append(p / prev if prev > 0 else None)
        prev = p
    return out


def extend_curve(curve: Sequence[float], k_max: int) -> list[float]:
    """The curve up to k_max positions; beyond the measured ones, decay by the last conditional rate.

    The last measured conditional rate is the best available guess for deeper positions (acceptance
    conditioned on a long accepted prefix changes slowly), and it never invents a rise.
    """
    out = [min(max(float(p), 0.0), 1.0) for p in curve[:k_max]]
    if len(out) >= k_max:
        return out
    if not out:
        return [0.0] * k_max
    rates = [r for r in conditional_rates(out) if r is not None]
    r = min(rates[-1], 1.0) if rates else 0.0
    while len(out) < k_max:
        out.append(out[-1] * r)
    return out


def expected_tokens_from_curve(curve: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum of the first k unconditional acceptances (extrapolated past the measured)."""
    if k <= 0:
        return 1.0
    return 1.0 + sum(extend_curve(curve, k))


def speedup(expected_tokens: float, k: int, cost_ratio: float, round_cost: float = 0.0) -> float:
    """S = E / (1 + f + k*c): tokens per pass over the cost of one pass, k draft steps and, with
    `round_cost` f, what a speculative step costs whatever k (see `step_costs`)."""
    return expected_tokens / (1.0 + round_cost + k * cost_ratio)


def step_costs(k1: int, cost1: float, k2: int, cost2: float) -> tuple[float, float]:
    """(f, c) of a step costing 1 + f + k c plain steps, from two chains' measured step costs
    (tokens per step / speedup, in plain steps) at k1 < k2: c from the slope, f what is left at k1,
    both at least 0. A fixed f is what a speculative step pays whatever k (the drafter's commit, the
    verify's extra token, launches, the host's read): on a GPU with a small target it can be most of
    the step's extra cost."""
    if not 1 <= k1 < k2:
        raise ValueError(f"expected 1 <= k1 < k2, got k1={k1}, k2={k2}")
    c = max(0.0, (cost2 - cost1) / (k2 - k1))
    return max(0.0, cost1 - 1.0 - c * k1), c


def cost_ratio_from_speedup(expected_tokens: float, k: int, measured_speedup: float) -> float:
    """The draft/target cost ratio c that makes `speedup` give the measured speedup of a chain of k
    (c = (E/S - 1) / k, at least 0): a measured c that also absorbs the verify step's extra cost."""
    if k < 1 or measured_speedup <= 0:
        raise ValueError(f"expected k >= 1 and a positive speedup, got k={k}, speedup={measured_speedup}")
    return max(0.0, (expected_tokens / measured_speedup - 1.0) / k)


def break_even_cost_ratio(expected_tokens: float, k: int) -> float | None:
    """The largest draft/target cost ratio at which speculation still pays: c* = (E - 1) / k."""
    if k <= 0:
        return None
    return (expected_tokens - 1.0) / k


def speedup_by_k(curve: Sequence[float], cost_ratio: float, k_max: int = DEFAULT_K_MAX,
                 round_cost: float = 0.0) -> list[KPoint]:
    """Predicted speedup for k = 1..k_max with the (extrapolated) measured curve."""
    full = extend_curve(curve, k_max)
    points = []
    e = 1.0
    for k in range(1, k_max + 1):
        e += full[k - 1]
        points.append(KPoint(k=k, expected_tokens=e, speedup=speedup(e, k, cost_ratio, round_cost)))
    return points


def best_k(curve: Sequence[float], cost_ratio: float, k_max: int = DEFAULT_K_MAX,
           round_cost: float = 0.0) -> KPoint:
    """The k with the highest predicted speedup; k=0 (speculation off, S=1) when none beats it."""
    best = KPoint(k=0, expected_tokens=1.0, speedup=1.0)
    for point in speedup_by_k(curve, cost_ratio, k_max, round_cost):
        if point.speedup > best.speedup + 1e-12:
            best = point
    return best
