"""Acceptance figures from counter values: the formulas, and what each engine's counters mean.

vLLM v1 and specdec count a *prefix*: a draft whose first two tokens match adds 2 to
`num_accepted_tokens`, and `accepted_tokens_per_pos[i]` counts drafts with at least i+1 accepted.
So, per draft:

    acceptance_rate         = accepted / draft_tokens
    mean_acceptance_length  = 1 + accepted / drafts          (tokens per target pass, bonus included)
    per-position            = per_pos[i] / drafts            (P(at least i+1 accepted))
    conditional             = per_pos[i] / per_pos[i-1]      (P(i accepted | i-1 accepted))

Scrapes without `num_drafts` (vLLM v0, early v1) carry only draft and accepted token counts, and
vLLM v0 counted every matching position, not the prefix. Those are read as an i.i.d. per-position
acceptance a = accepted / draft_tokens, so E = (1 - a^(k+1)) / (1 - a): the conservative reading.

SGLang reports `spec_accept_length` (tokens per verify pass, bonus included) and
`spec_accept_rate` = (accepted + bonus) / tree size, so tree size = length / rate and the
vLLM-comparable draft acceptance is (length - 1) / (tree size - 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..errors import SpecdecError
from . import theory
from .metrics import LabelSet, SGLangSeries, SpecSeries

PREFIX = "prefix"  # vLLM v1 / specdec: accepted counts the accepted prefix of each draft
INDEPENDENT = "independent"  # vLLM v0 (or unknown): accepted counts every matching position
SGLANG = "sglang"  # gauges: accept length and (accepted + bonus) / tree size


def acceptance_rate(accepted: float | None, draft_tokens: float | None) -> float | None:
    """Fraction of drafted tokens the target accepted."""
    if accepted is None or not draft_tokens:
        return None
    return accepted / draft_tokens


def mean_acceptance_length(accepted: float | None, drafts: float | None) -> float | None:
    """Tokens committed per target pass that verified a draft: 1 + accepted / drafts."""
    if accepted is None or not drafts:
        return None
    return 1.0 + accepted / drafts


def per_position_unconditional(per_pos: Sequence[float], drafts: float | None) -> list[float] | None:
    """P(at least i+1 tokens of a draft accepted) = per_pos[i] / drafts."""
    if not drafts or not per_pos:
        return None
    return [v / drafts for v in per_pos]


def per_position_conditional(per_pos: Sequence[float], drafts: float | None) -> list[float | None] | None:
    """P(position i accepted | position i-1 accepted) = per_pos[i] / per_pos[i-1]; i=0 over drafts."""
    if not drafts or not per_pos:
        return None
    out: list[float | None] = []
    prev = drafts
    for v in per_pos:
        out.append(v / prev if prev else None)
        prev = v
    return out


@dataclass(kw_only=True)
class Acceptance:
    """One label set's (or the aggregate's) acceptance, with where each figure came from."""

    labels: LabelSet = ()
    counting: str = PREFIX
    num_drafts: float | None = None
    num_draft_tokens: float | None = None
    num_accepted_tokens: float | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    k: int | None = None
    k_source: str = ""
    per_position: list[float] | None = None  # measured unconditional curve
    per_position_conditional: list[float | None] | None = None
    curve: list[float] = field(default_factory=list)  # for theory: measured, or an i.i.d. estimate
    curve_source: str = ""  # "measured" | "i.i.d. estimate"
    notes: list[str] = field(default_factory=list)
    reset: bool = False

    @property
    def has_data(self) -> bool:
        return self.mean_acceptance_length is not None and self.k is not None and self.k > 0

    def as_dict(self) -> dict:
        return {
            "labels": dict(self.labels),
            "counting": self.counting,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "k": self.k,
            "k_source": self.k_source,
            "per_position_acceptance": self.per_position,
            "per_position_conditional": self.per_position_conditional,
            "per_position_available": self.per_position is not None,
            "acceptance_curve": self.curve,
            "acceptance_curve_source": self.curve_source,
            "counter_reset": self.reset,
            "notes": list(self.notes),
        }


def _dense(per_pos: dict[int, float]) -> list[float] | None:
    """Positions 0..max as a list; None when missing or with holes (a partial scrape)."""
    if not per_pos:
        return None
    n = max(per_pos) + 1
    if set(per_pos) != set(range(n)):
        return None
    return [per_pos[i] for i in range(n)]


def from_spec_series(series: SpecSeries, *, k: int | None = None, k_hint: int | None = None) -> Acceptance:
    """Acceptance from vLLM-named counters; `k` overrides (or supplies) the draft length, `k_hint`
    is the k the server states it serves (used before inferring k from the counters)."""
    per_pos = _dense(series.accepted_per_pos)
    drafts = series.num_drafts
    out = Acceptance(
        labels=series.labels,
        num_draft_tokens=series.num_draft_tokens,
        num_accepted_tokens=series.num_accepted_tokens,
        reset=series.reset,
    )
    if series.reset:
        out.notes.append("a counter went backwards (server restart): counted from the restart")
    if series.accepted_per_pos and per_pos is None:
        out.notes.append("per-position series have holes; ignored")

    accepted = series.num_accepted_tokens
    if accepted is None and per_pos is not None:
        accepted = sum(per_pos)  # per_pos sums to accepted under prefix counting
        out.num_accepted_tokens = accepted

    if drafts is not None:
        out.counting = PREFIX
        out.num_drafts = drafts
        inferred, source = None, ""
        if per_pos is not None:
            inferred, source = len(per_pos), "per-position series"
        if drafts and series.num_draft_tokens:
            # Series created lazily stop at the deepest position ever accepted: trust the ratio
            # when it says more (vLLM pre-creates all k, so there both agree).
            ratio_k = round(series.num_draft_tokens / drafts)
            if inferred is None or ratio_k > inferred:
                inferred, source = ratio_k, "draft_tokens / drafts"
        if k is None and k_hint is not None:
            k, k_source_hint = k_hint, "specdec:build_info"
        else:
            k_source_hint = "--k"
        if k is not None:
            if inferred is not None and inferred != k:
                out.notes.append(f"k = {k} from {k_source_hint} overrides k = {inferred} from the {source}")
            out.k, out.k_source = k, k_source_hint
        else:
            out.k, out.k_source = inferred, source
        out.acceptance_rate = acceptance_rate(accepted, series.num_draft_tokens)
        out.mean_acceptance_length = mean_acceptance_length(accepted, drafts)
        if per_pos is not None and out.k is not None:
            per_pos = (per_pos + [0.0] * out.k)[: out.k]  # positions never accepted: zero
        out.per_position = per_position_unconditional(per_pos or [], drafts)
        out.per_position_conditional = per_position_conditional(per_pos or [], drafts)
        if out.per_position is not None:
            out.curve, out.curve_source = list(out.per_position), "measured"
        elif out.mean_acceptance_length is not None and out.k:
            a = theory.fit_iid_rate(out.mean_acceptance_length - 1.0, out.k)
            out.curve, out.curve_source = theory.iid_curve(a, out.k), "i.i.d. estimate"
            out.notes.append(
                "no per-position series: per-position acceptance unavailable; the curve used "
                f"for other k is an i.i.d. fit (a = {a:.3f}) to the mean"
            )
        return out

    # No num_drafts: vLLM v0 (accepted counts every matching position) or an early v1.
    out.counting = INDEPENDENT
    out.k, out.k_source = (k, "--k") if k is not None else (None, "")
    out.acceptance_rate = acceptance_rate(accepted, series.num_draft_tokens)
    if out.k and out.acceptance_rate is not None and series.num_draft_tokens:
        a = out.acceptance_rate
        passes = series.num_draft_tokens / out.k
        out.num_drafts = passes
        if series.num_emitted_tokens:
            out.mean_acceptance_length = series.num_emitted_tokens / passes
        else:
            out.mean_acceptance_length = theory.expected_tokens_iid(a, out.k)
        out.curve, out.curve_source = theory.iid_curve(a, out.k), "i.i.d. estimate"
        upper = 1.0 + out.k * a
        out.notes.append(
            "no vllm:spec_decode_num_drafts counter (vLLM v0 or an early v1): acceptance read as "
            f"an i.i.d. per-position rate a = {a:.3f}, so E = (1 - a^(k+1)) / (1 - a); if these are "
            f"prefix counts (v1), E would be 1 + k*a = {upper:.2f}"
        )
    return out


def from_sglang_series(series: SGLangSeries, *, k: int | None = None) -> Acceptance:
    """Acceptance from SGLang's gauges (the latest log interval)."""
    out = Acceptance(labels=series.labels, counting=SGLANG)
    length = series.accept_length
    if not length:
        return out
    out.mean_acceptance_length = length
    tree = series.num_draft_tokens
    rate = series.accept_rate
    if tree and rate:
        # Older SGLang: rate = length / tree; newer: (length - 1) / (tree - 1). Pick the closer.
        if tree > 1 and abs(rate - (length - 1) / (tree - 1)) < abs(rate - length / tree):
            out.notes.append("spec_accept_rate counts draft tokens only (newer SGLang)")
    elif rate:
        tree = length / rate
    if k is not None:
        out.k, out.k_source = k, "--k"
        tree = tree or k + 1
    elif tree:
        out.k, out.k_source = max(1, round(tree) - 1), "SGLang tree size (accept_length / accept_rate)"
    if tree and tree > 1:
        out.acceptance_rate = (length - 1.0) / (tree - 1.0)
    if out.k:
        a = theory.fit_iid_rate(length - 1.0, out.k)
        out.curve, out.curve_source = theory.iid_curve(a, out.k), "i.i.d. estimate"
    out.notes.append(
        "SGLang exposes no per-position counters: per-position acceptance unavailable; the curve "
        "used for other k is an i.i.d. fit to spec_accept_length (trees make k approximate)"
    )
    return out


def aggregate_spec(series: Sequence[SpecSeries]) -> SpecSeries:
    """Sum counters over label sets (per-position only when all sets share the same positions)."""
    def total(attr: str) -> float | None:
        values = [getattr(s, attr) for s in series]
        return None if any(v is None for v in values) else sum(values)

    positions = [set(s.accepted_per_pos) for s in series]
    per_pos: dict[int, float] = {}
    if positions and all(p == positions[0] for p in positions) and positions[0]:
        for s in series:
            for p, v in s.accepted_per_pos.items():
                per_pos[p] = per_pos.get(p, 0.0) + v
    return SpecSeries(
        labels=(),
        num_drafts=total("num_drafts"),
        num_draft_tokens=total("num_draft_tokens"),
        num_accepted_tokens=total("num_accepted_tokens"),
        num_emitted_tokens=total("num_emitted_tokens"),
        accepted_per_pos=per_pos,
        reset=any(s.reset for s in series),
    )


def aggregate_sglang(series: Sequence[SGLangSeries]) -> SGLangSeries:
    """Gauges carry no weights: the aggregate is the mean over label sets that report a value."""
    live = [s for s in series if s.accept_length]

    def mean(attr: str) -> float | None:
        values = [getattr(s, attr) for s in live if getattr(s, attr)]
        return sum(values) / len(values) if values else None

    return SGLangSeries(
        labels=(),
        accept_length=mean("accept_length"),
        accept_rate=mean("accept_rate"),
        num_draft_tokens=mean("num_draft_tokens"),
    )


def summarize(scrape, *, k: int | None = None) -> tuple[Acceptance, list[Acceptance]]:
    """(aggregate, per label set) acceptance of a scrape or of a delta between two."""
    if scrape.spec:
        hint = scrape.k_hint
        parts = [from_spec_series(s, k=k, k_hint=hint) for s in scrape.spec.values()]
        overall = from_spec_series(aggregate_spec(list(scrape.spec.values())), k=k, k_hint=hint)
        ks = {p.k for p in parts if p.k}
        if len(parts) > 1 and len(ks) > 1:
            overall.notes = [n for n in overall.notes if not n.startswith("no per-position")]
            overall.notes.append(
                f"label sets use different k ({', '.join(map(str, sorted(ks)))}): the aggregate's k "
                "is rounded from draft_tokens / drafts and its curve is an i.i.d. fit; judge each "
                "label set on its own (per_label_set)"
            )
    elif scrape.sglang:
        parts = [from_sglang_series(s, k=k) for s in scrape.sglang.values()]
        overall = from_sglang_series(aggregate_sglang(list(scrape.sglang.values())), k=k)
    else:
        raise SpecdecError(f"no speculative-decoding metrics in {scrape.source}")
    if len(parts) == 1:
        overall.labels = parts[0].labels
    return overall, parts
