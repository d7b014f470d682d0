"""The sweep: the drafter's acceptance under each hypothesis of what serving got wrong.

Every hypothesis is one run-time switch: the aux layer ids shifted by -1/+1 (an EAGLE vs
SpecForge/ModelOpt/SGLang id convention mixed up), the last state taken after the final norm
instead of before, `norm_before_residual` flipped, an identity vocab mapping (a lost or ignored
`d2t`), one aux state fed as zeros (what vLLM once fed for the last id of a DeepSeek/Kimi target),
and the weights rescaled to the norms training recorded. All are measured with the engine on the
same prompts. A hypothesis names the mismatch only when it beats the drafter as configured by
more than the noise of the measurement (`specdec.diagnose.stats`); and each row says whether the
switch moves acceptance at all on this target, since a one-layer shift of a 30-layer target's
taps may not, and then a sweep that finds nothing is no evidence of health.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from ..diagnose.stats import acceptance_length_se, differ
from ..engine.engine import SpeculativeEngine

MIN_GAIN = 0.15  # acceptance length a hypothesis must add, beyond noise, to be named


@dataclass
class Hypothesis:
    name: str
    meaning: str
    fix: str
    apply: Callable  # (target, drafter) -> undo callable, or None when it does not apply
    # What the drafter is fed under the switch, given the ids it then reads.
    fed: Callable[[list[int]], str] = lambda ids: f"hidden_states{ids}"


def _shift(delta: int):
    def apply(target, drafter):
        # The engine makes the target capture whatever ids the drafter's config names.
        old = list(drafter.cfg.aux_layer_ids)
        ids = [i + delta for i in old]
        if min(ids) < 0 or max(ids) > target.num_layers:
            return None
        drafter.cfg.aux_layer_ids = ids
        return lambda: setattr(drafter.cfg, "aux_layer_ids", old)

    return apply


def _post_norm(target, drafter):
    if target.num_layers not in drafter.cfg.aux_layer_ids:
        return None
    old = target.last_state
    target.last_state = "post_norm"
    return lambda: setattr(target, "last_state", old)


def _flip_residual(target, drafter):
    drafter.cfg.norm_before_residual = not drafter.cfg.norm_before_residual
    return lambda: setattr(drafter.cfg, "norm_before_residual", not drafter.cfg.norm_before_residual)


def _identity_vocab(target, drafter):
    if not drafter.d2t.any():
        return None
    old = drafter.d2t.clone()
    drafter.d2t.zero_()
    return lambda: drafter.d2t.copy_(old)


def zero_aux_slot(drafter, slot: int):
    """Make the drafter see zeros for aux state `slot`: its fc columns zeroed, which is exactly
    feeding a zero state (the norms before fc map zeros to zeros). Returns the undo."""
    tH = drafter.cfg.target_hidden_size
    cols = slice(slot * tH, (slot + 1) * tH)
    old = drafter.fc.weight[:, cols].clone()
    drafter.fc.weight[:, cols] = 0
    return lambda: drafter.fc.weight[:, cols].copy_(old)


def _zero_aux(slot: int):
    def apply(target, drafter):
        if slot >= len(drafter.cfg.aux_layer_ids) or drafter.cfg.norm_before_fc:
            return None
        return zero_aux_slot(drafter, slot)

    return apply


def _rescale(target, drafter):
    recorded = (drafter.cfg.provenance or {}).get("weight_norms") or {}
    params = dict(drafter.named_parameters())
    factors = {n: recorded[n] / float(params[n].norm()) for n in recorded if n in params and float(params[n].norm())}
    factors = {n: f for n, f in factors.items() if abs(f - 1) > 0.05}
    if not factors:
        return None
    old = {n: params[n].detach().clone() for n in factors}
    for n, f in factors.items():
        params[n].mul_(f)

    def undo():
        for n, w in old.items():
            params[n].copy_(w)

    return undo


HYPOTHESES = [
    Hypothesis("aux ids -1", "the drafter's ids are one layer too deep for this target",
               "the ids were written as layer inputs but trained on layer outputs (SpecForge/ModelOpt "
               "counting): re-export with ids - 1 (`specdec convert --layer-convention eagle`)", _shift(-1)),
    Hypothesis("aux ids +1", "the drafter's ids are one layer too shallow for this target",
               "the ids were written in SpecForge/ModelOpt counting (layer outputs) but read as EAGLE/vLLM "
               "ids: re-export with `specdec convert --layer-convention specforge`", _shift(+1)),
    Hypothesis("last state after norm", "the last aux state was captured after the final norm in training",
               "capture/serve the last layer's state after the final norm, or retrain", _post_norm),
    Hypothesis("norm_before_residual flipped", "training used the other residual convention",
               "set norm_before_residual to the other value in the drafter config", _flip_residual),
    Hypothesis("identity d2t", "the lm_head rows are target ids, not a reduced vocab",
               "drop d2t (or export with an identity mapping); the drafter was trained without one",
               _identity_vocab),
    *(Hypothesis(f"aux state {s} zero", f"the drafter is fed zeros for aux state {s}",
                 f"the server feeds nothing for the drafter's aux state {s}: check that it captures that layer "
                 f"(vLLM once captured nothing for the last id of DeepSeek/Kimi targets, PR 46788)",
                 _zero_aux(s), lambda ids, s=s: f"hidden_states{ids} with [{ids[s]}] as zeros")
      for s in range(3)),
    Hypothesis("weights rescaled to training's norms", "the weights were scaled after training",
               "re-export the drafter from its training run; a tensor's norm differs from what train saved",
               _rescale),
]
# Hypotheses that break a healthy drafter rather than repair a broken one: they show whether the
# measurement can see a fault of that kind, never name a mismatch.
PROBES = {"aux state 0 zero", "aux state 1 zero", "aux state 2 zero"}


@contextmanager
def switched(h: Hypothesis, target, drafter):
    """Hypothesis `h` applied for the body (yields False when it does not apply), then undone."""
    with torch.no_grad():
        undo = h.apply(target, drafter)
    try:
        yield undo is not None
    finally:
        if undo is not None:
            with torch.no_grad():
                undo()


def measure_engine(target, drafter, tokenizer, conversations, *, k: int, max_tokens: int,
                   progress: bool = False) -> dict:
    """The drafter's acceptance with specdec's engine on these prompts, greedy, as switched now."""
    from ..evaluate import evaluate

    engine = SpeculativeEngine(target, drafter=drafter, k=k)
    r = evaluate(engine, tokenizer, conversations, max_new_tokens=max_tokens, progress=progress, warmup=False)
    return {key: r[key] for key in ("k", "num_drafts", "mean_acceptance_length", "per_position_acceptance",
                                    "accepted_per_position", "new_tokens")}


def _se(row: dict) -> float:
    n = row.get("num_drafts")
    return acceptance_length_se(row.get("per_position_acceptance") or [], n) if n else 0.0


def diagnose_drafter(target, drafter, tokenizer, conversations, *, k: int = 5, max_new_tokens: int = 48,
                     progress: bool = False, measure: Callable[[], dict] | None = None) -> dict:
    """Acceptance under each hypothesis. `measure` (default: the engine over `conversations`)
    returns the engine summary (mean_acceptance_length, per_position_acceptance, num_drafts) for
    the current switches."""
    measure = measure or (lambda: measure_engine(target, drafter, tokenizer, conversations, k=k,
                                                 max_tokens=max_new_tokens, progress=progress))
    configured_ids = list(drafter.cfg.aux_layer_ids)
    base = measure()
    base_al, base_se = base["mean_acceptance_length"], _se(base)
    rows = [{"hypothesis": "as configured", **base, "se": base_se}]
    for h in HYPOTHESES:
        with switched(h, target, drafter) as applies:
            if not applies:
                continue
            m = measure()
        se = _se(m)
        rows.append({"hypothesis": h.name, "meaning": h.meaning, "fix": h.fix, **m, "se": se,
                     "delta": m["mean_acceptance_length"] - base_al,
                     "changes_acceptance": differ(m["mean_acceptance_length"], se, base_al, base_se)
                     and abs(m["mean_acceptance_length"] - base_al) > 0.05})
    target.set_aux_layer_ids(configured_ids)
    candidates = [r for r in rows[1:] if r["hypothesis"] not in PROBES]
    best = max(candidates, key=lambda r: r["mean_acceptance_length"], default=None)
    found = (best is not None and best["changes_acceptance"] and best["delta"] > MIN_GAIN
             and best["mean_acceptance_length"] > 1.2 * base_al)
    blind = [r["hypothesis"] for r in rows[1:] if not r["changes_acceptance"]]
    noise = f" (+/- {3 * base_se:.2f} at 3 standard errors)" if base_se else ""
    if found:
        verdict = (f"likely mismatch: {best['hypothesis']} ({best['meaning']}): mean acceptance length "
                   f"{base_al:.2f} -> {best['mean_acceptance_length']:.2f}{noise}; fix: {best['fix']}")
    else:
        verdict = (f"no convention mismatch found: no hypothesis beats the drafter as configured "
                   f"({base_al:.2f}{noise}) by more than the noise")
        if blind:
            verdict += (f"; on this target {', '.join(blind)} do not change acceptance measurably, so such a "
                        f"fault would not show here")
    return {"verdict": verdict, "mismatch": best["hypothesis"] if found else None, "baseline": base, "rows": rows,
            "k": k, "aux_layer_ids": configured_ids, "insensitive": blind,
            "baseline_se": base_se if math.isfinite(base_se) else None}
