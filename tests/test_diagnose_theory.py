"""Golden values for the speculative-decoding theory diagnose relies on."""

import math

import pytest

from specdec.diagnose import theory


def test_iid_expected_tokens_matches_closed_form_and_sum():
    for a in (0.0, 0.156, 0.5, 0.8, 0.99):
        for k in (1, 3, 5, 8):
            closed = theory.expected_tokens_iid(a, k)
            assert closed == pytest.approx(1 + sum(a ** (i + 1) for i in range(k)))
            assert theory.expected_tokens_from_curve(theory.iid_curve(a, k), k) == pytest.approx(closed)
    assert theory.expected_tokens_iid(1.0, 4) == 5.0
    assert theory.expected_tokens_iid(0.7, 0) == 1.0


def test_seed_case_theory():
    a = 1119 / 7190  # 15.6%
    e = theory.expected_tokens_iid(a, 5)
    assert e == pytest.approx(1.1843, abs=1e-3)
    c_star = theory.break_even_cost_ratio(e, 5)
    assert 0.036 < c_star < 0.038  # "loses for any c > 0.04" (rounded)
    assert theory.speedup(e, 5, 0.04) < 1.0
    assert theory.speedup(e, 5, 0.03) > 1.0
    best = theory.best_k(theory.iid_curve(a, 5), 0.05)
    assert best.k == 1
    assert best.speedup == pytest.approx((1 + a) / 1.05)


def test_fit_iid_rate_inverts_the_chain_sum():
    for a in (0.05, 0.3, 0.62, 0.9):
        for k in (1, 2, 5):
            mean_accepted = sum(a ** (i + 1) for i in range(k))
            assert theory.fit_iid_rate(mean_accepted, k) == pytest.approx(a, abs=1e-9)
    assert theory.fit_iid_rate(0.0, 5) == 0.0
    assert theory.fit_iid_rate(5.0, 5) == 1.0


def test_extend_curve_uses_last_conditional_rate():
    curve = [0.8, 0.6, 0.45]  # conditional: 0.8, 0.75, 0.75
    ext = theory.extend_curve(curve, 6)
    assert ext[:3] == curve
    assert ext[3] == pytest.approx(0.45 * 0.75)
    assert ext[5] == pytest.approx(0.45 * 0.75**3)
    assert theory.extend_curve(curve, 2) == [0.8, 0.6]
    # Single position: the conditional rate is p0 itself.
    assert theory.extend_curve([0.5], 3) == pytest.approx([0.5, 0.25, 0.125])


def test_measured_curve_drives_best_k_not_a_constant_rate():
    # Position 0 strong, then a cliff: k=1 is best at c=0.1 even though the mean is fine.
    curve = [0.9, 0.1, 0.05]
    points = theory.speedup_by_k(curve, 0.1, 5)
    assert [p.k for p in points] == [1, 2, 3, 4, 5]
    assert points[0].expected_tokens == pytest.approx(1.9)
    assert points[0].speedup == pytest.approx(1.9 / 1.1)
    assert points[1].speedup == pytest.approx(2.0 / 1.2)
    assert theory.best_k(curve, 0.1, 5).k == 1
    # With a smooth curve and a cheap drafter, deeper is better.
    assert theory.best_k([0.9, 0.81, 0.73], 0.01, 10).k >= 5


def test_best_k_zero_when_nothing_beats_plain_decoding():
    best = theory.best_k([0.02, 0.001], 0.2, 8)
    assert best.k == 0 and best.speedup == 1.0


def test_conditional_rates_handles_zero():
    assert theory.conditional_rates([0.5, 0.0, 0.0]) == [0.5, 0.0, None]
    assert all(math.isfinite(x) for x in theory.extend_curve([0.5, 0.0], 5))


def test_cost_ratio_from_speedup_inverts_speedup():
    for e, k, c in ((1.38, 5, 0.104), (3.2, 7, 0.05), (1.9, 1, 0.3)):
        assert math.isclose(theory.cost_ratio_from_speedup(e, k, theory.speedup(e, k, c)), c, rel_tol=1e-12)
    assert theory.cost_ratio_from_speedup(2.0, 2, 2.5) == 0.0  # faster than free drafts: clipped at 0
    with pytest.raises(ValueError):
        theory.cost_ratio_from_speedup(2.0, 0, 1.0)
