"""From acceptance to a verdict a person can act on: does speculation pay, why, and what to try.

The verdict compares predicted speedup S = E / (1 + k*c) at the server's k against 1: below it
speculation loses, up to MARGINAL_BELOW it is marginal, above it is healthy. The recommended k
maximizes S over the measured (or estimated) per-position curve. Counters alone cannot say
whether an acceptance is good, so with a reference (this drafter's own held-out acceptance, or
published EAGLE-3 figures, labelled as such) an acceptance far below it is the verdict, whatever
the cost: that is a fault to find (`specdec doctor --server`), not a k to tune. A cost ratio that
is assumed is said to be, with the range of c over which the verdict holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import theory
from .acceptance import INDEPENDENT, SGLANG, Acceptance

FAR_BELOW = "acceptance far below reference"
LOSES = "speculation loses"
MARGINAL = "marginal"
HEALTHY = "healthy"
NO_DATA = "no data"

MARGINAL_BELOW = 1.2  # under 1.2x the drafter's memory and latency variance rarely pay for it
# A working EAGLE-3 drafter accepts ~60-90% of position-0 tokens; under this, the drafter is
# usually reading the wrong target hidden states rather than being merely undertrained.
LOW_POSITION0 = 0.35
MIN_GAIN = 1.03  # a predicted gain under 3% is inside the model's error: don't suggest a change
# Accepted tokens per step under this share of the reference's: not a weaker drafter, a fault.
FAR_BELOW_SHARE = 0.6
PLAUSIBLE_COST_RATIOS = (0.02, 0.05, 0.1, 0.2)


@dataclass(frozen=True)
class Reference:
    """An acceptance length the live one is held against, at `k` drafts per step."""

    mean_acceptance_length: float
    k: int
    label: str

    def at(self, k: int) -> float:
        """The reference's expected tokens per step at another k: an i.i.d. fit of its own, not
        extrapolated above its k (a claim of "far below" stays conservative)."""
        a = theory.fit_iid_rate(self.mean_acceptance_length - 1, self.k)
        return theory.expected_tokens_iid(a, min(k, self.k))


# DESIGN.md's anchors: SpecForge's published Llama-3.1-8B drafter, MT-Bench, 3 steps, batch 1.
PUBLISHED_EAGLE3 = Reference(2.90, 3, "published EAGLE-3 drafters (SpecForge's Llama-3.1-8B drafter: 2.90 at "
                                      "k = 3 on MT-Bench), if this server runs an EAGLE-3 drafter")


@dataclass(kw_only=True)
class Verdict:
    verdict: str
    headline: str
    speed_verdict: str = ""  # loses / marginal / healthy at the cost ratio, whatever the reference says
    cost_ratio: float
    cost_ratio_assumed: bool = False
    reasons: list[str] = field(default_factory=list)
    next_steps: list[str] = field(default_factory=list)
    expected_tokens_per_pass: float | None = None
    predicted_speedup: float | None = None
    break_even_cost_ratio: float | None = None
    recommended_k: int | None = None
    recommended_speedup: float | None = None
    speedup_by_k: list[theory.KPoint] = field(default_factory=list)
    position0_acceptance: float | None = None
    position0_estimated: bool = False

    def as_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "speed_verdict": self.speed_verdict,
            "headline": self.headline,
            "reasons": list(self.reasons),
            "next_steps": list(self.next_steps),
            "cost_ratio": self.cost_ratio,
            "cost_ratio_assumed": self.cost_ratio_assumed,
            "expected_tokens_per_pass": self.expected_tokens_per_pass,
            "predicted_speedup": self.predicted_speedup,
            "break_even_cost_ratio": self.break_even_cost_ratio,
            "recommended_k": self.recommended_k,
            "recommended_speedup": self.recommended_speedup,
            "speedup_by_k": [p.as_dict() for p in self.speedup_by_k],
            "position0_acceptance": self.position0_acceptance,
            "position0_estimated": self.position0_estimated,
        }


def classify(speedup: float) -> str:
    if speedup < 1.0:
        return LOSES
    if speedup < MARGINAL_BELOW:
        return MARGINAL
    return HEALTHY


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _k_flag(counting: str, k: int) -> str:
    if counting == SGLANG:
        return f"SGLang: --speculative-num-steps {k} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
    return f"vLLM: --speculative-config '{{\"num_speculative_tokens\": {k}, ...}}'"


def judge(acc: Acceptance, *, cost_ratio: float | None = None, k_max: int | None = None,
          reference: Reference | None = None) -> Verdict:
    """The verdict for one acceptance summary at draft/target cost ratio c (default 0.05, assumed),
    held against `reference` when one is known."""
    assumed = cost_ratio is None
    c = theory.DEFAULT_COST_RATIO if assumed else float(cost_ratio)
    if not acc.has_data:
        return Verdict(
            verdict=NO_DATA,
            headline="no drafts in this window: nothing to judge",
            cost_ratio=c,
            cost_ratio_assumed=assumed,
            reasons=["no speculative steps were counted; send traffic to the server and re-run"],
        )
    k = int(acc.k)
    e = float(acc.mean_acceptance_length)
    s = theory.speedup(e, k, c)
    c_star = theory.break_even_cost_ratio(e, k)
    k_max = k_max or max(theory.DEFAULT_K_MAX, 2 * k)
    points = theory.speedup_by_k(acc.curve, c, k_max) if acc.curve else []
    best = theory.best_k(acc.curve, c, k_max) if acc.curve else None
    verdict = classify(s)
    c_note = " (assumed; measure it and pass --cost-ratio)" if assumed else ""
    headline = f"{verdict}: {s:.2f}x predicted at k = {k}, c = {c:g}"
    if assumed and c_star is not None:
        headline += f" (assumed; {'pays only while c < ' + format(c_star, '.3f') if c_star > 0 else 'never pays'})"
    ref_e = reference.at(k) if reference is not None else None
    far_below = ref_e is not None and e - 1 < FAR_BELOW_SHARE * (ref_e - 1)
    if far_below:
        verdict = FAR_BELOW
        loses = (f"speculation loses at any cost ratio above {max(c_star or 0, 0):.3f}" if c_star is not None
                 else "speculation cannot pay")
        headline = (f"{FAR_BELOW}: {e:.2f} against ~{ref_e:.2f} tokens per step at k = {k} ({reference.label}); "
                    f"{loses}; run `specdec doctor --server`")

    out = Verdict(
        verdict=verdict,
        speed_verdict=classify(s),
        headline=headline,
        cost_ratio=c,
        cost_ratio_assumed=assumed,
        expected_tokens_per_pass=e,
        predicted_speedup=s,
        break_even_cost_ratio=c_star,
        speedup_by_k=points,
        recommended_k=best.k if best else None,
        recommended_speedup=best.speedup if best else None,
    )
    r = out.reasons
    if acc.acceptance_rate is not None:
        counts = ""
        if acc.num_accepted_tokens is not None and acc.num_draft_tokens:
            counts = f" ({acc.num_accepted_tokens:,.0f} of {acc.num_draft_tokens:,.0f} draft tokens)"
        r.append(f"acceptance rate {_pct(acc.acceptance_rate)}{counts} with k = {k} drafts per step")
    r.append(
        f"expected tokens per target pass E = {e:.2f} (plain decoding gives 1; the ceiling at "
        f"k = {k} is {k + 1})"
    )
    if c_star is not None:
        loses_above = f"speculation loses for any c > {c_star:.3f}" if c_star > 0 else "it never pays"
        r.append(
            f"break-even: speculation pays only when E > 1 + k*c; with E = {e:.2f} and k = {k} "
            f"that needs c < {max(c_star, 0):.3f}, so {loses_above}"
        )
    r.append(
        f"at c = {c:g}{c_note} one speculative step costs {1 + k * c:.2f} target passes and "
        f"commits {e:.2f} tokens: predicted speedup {s:.2f}x"
    )
    if assumed:
        r.append("over plausible cost ratios: " + ", ".join(
            f"c = {x:g}: {theory.speedup(e, k, x):.2f}x ({classify(theory.speedup(e, k, x))})"
            for x in PLAUSIBLE_COST_RATIOS))
    if ref_e is not None:
        r.append(f"reference: {reference.label}; at k = {k} that is ~{ref_e:.2f} tokens per step against "
                 f"{e:.2f} here ({100 * (e - 1) / max(ref_e - 1, 1e-9):.0f}% of its accepted tokens)")

    # Position 0 tells a broken drafter from a weak one.
    if acc.per_position:
        p0, estimated = acc.per_position[0], False
    elif acc.curve:
        p0, estimated = acc.curve[0], True
    else:
        p0, estimated = None, True
    out.position0_acceptance, out.position0_estimated = p0, estimated
    if acc.per_position and len(acc.per_position) > 1:
        cond = [x for x in (acc.per_position_conditional or []) if x is not None]
        shape = ", ".join(_pct(x) for x in acc.per_position)
        r.append(f"per-position acceptance P(at least i+1 accepted): {shape}")
        if cond and len(cond) > 1:
            r.append(
                "conditional acceptance per position: " + ", ".join(_pct(x) for x in cond)
            )
    low_p0 = p0 is not None and p0 < LOW_POSITION0
    if low_p0:
        how = "estimated from the mean, per-position series unavailable" if estimated else "measured"
        r.append(
            f"position-0 acceptance is {_pct(p0)} ({how}); a working EAGLE-3 drafter accepts "
            "60-90% of first tokens"
        )
    r.extend(acc.notes)

    n = out.next_steps
    if far_below:
        n.append(
            "run `specdec doctor --target TARGET --drafter DRAFTER --server URL`: acceptance this far under "
            "the reference usually means the server feeds the drafter other hidden states, another vocab "
            "mapping or another norm than training did; tuning k will not fix it"
        )
    if best is not None:
        if best.k == 0:
            n.append(
                f"turn speculation off for now: no k beats plain decoding at c = {c:g} with this "
                "acceptance curve (recommended_k = 0)"
            )
        elif best.k != k and best.speedup < s * MIN_GAIN:
            n.append(
                f"keep k = {k}: the best k = {best.k} would gain only "
                f"{100 * (best.speedup / s - 1):.0f}% ({best.speedup:.2f}x vs {s:.2f}x)"
            )
        elif best.k != k:
            n.append(
                f"try a {'lower' if best.k < k else 'higher'} k: k = {best.k} predicts "
                f"{best.speedup:.2f}x at c = {c:g} (vs {s:.2f}x at k = {k}); "
                f"{_k_flag(acc.counting, best.k)}"
            )
        else:
            n.append(f"keep k = {k}: it is already the best for c = {c:g}")
    if low_p0 and not far_below:
        n.append(
            "run `specdec doctor` on the drafter and target: position-0 acceptance this low "
            "usually means a hidden-state/layer-id mismatch (aux layer ids off by one, or a "
            "drafter trained against another target or tokenizer), not an undertrained drafter"
        )
    elif verdict not in (HEALTHY, FAR_BELOW):
        n.append(
            "improve the drafter: train longer or on data closer to the served traffic "
            "(specdec train), then compare with `specdec eval`"
        )
    if acc.counting == INDEPENDENT and not acc.per_position:
        n.append("upgrade vLLM (v1 >= 0.8.5) for num_drafts and per-position counters")
    if assumed:
        n.append(
            "measure the cost ratio c = draft step time / target step time and pass --cost-ratio"
        )
    return out
