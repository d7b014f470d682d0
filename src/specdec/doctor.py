"""`doctor`: name the mismatch that kills acceptance by measuring it under each hypothesis.

Every hypothesis is one run-time switch (see `HYPOTHESES`): the aux layer ids shifted by -1/+1
(an EAGLE-vs-SpecForge/ModelOpt/SGLang id convention mixed up), the last state taken after the
final norm instead of before, `norm_before_residual` flipped, an identity vocab mapping (a lost or
ignored `d2t`). The acceptance of each is measured with the engine on the same prompts; a
hypothesis that clearly beats the drafter as configured is the likely cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .engine.engine import SpeculativeEngine


@dataclass
class Hypothesis:
    name: str
    meaning: str
    fix: str
    apply: Callable  # (target, drafter) -> undo callable, or None when it does not apply


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
]


def diagnose_drafter(target, drafter, tokenizer, conversations, *, k: int = 5, max_new_tokens: int = 48,
                     progress: bool = False, measure: Callable[[], dict] | None = None) -> dict:
    """Acceptance under each hypothesis. `measure` (default: the engine over `conversations`)
    returns {mean_acceptance_length, per_position_acceptance} for the current switches."""
    from .evaluate import evaluate

    def engine_measure():
        engine = SpeculativeEngine(target, drafter=drafter, k=k)
        r = evaluate(engine, tokenizer, conversations, max_new_tokens=max_new_tokens, progress=progress, warmup=False)
        return {"mean_acceptance_length": r["mean_acceptance_length"],
                "per_position_acceptance": r["per_position_acceptance"]}

    measure = measure or engine_measure

    configured_ids = list(drafter.cfg.aux_layer_ids)
    base = measure()
    rows = [{"hypothesis": "as configured", **base}]
    for h in HYPOTHESES:
        with torch.no_grad():
            undo = h.apply(target, drafter)
        if undo is None:
            continue
        try:
            rows.append({"hypothesis": h.name, "meaning": h.meaning, "fix": h.fix, **measure()})
        finally:
            with torch.no_grad():
                undo()
    target.set_aux_layer_ids(configured_ids)
    best = max(rows, key=lambda r: r["mean_acceptance_length"])
    gain = best["mean_acceptance_length"] - base["mean_acceptance_length"]
    found = (best["hypothesis"] != "as configured" and gain > 0.15
             and best["mean_acceptance_length"] > 1.2 * base["mean_acceptance_length"])
    if found:
        verdict = (f"likely mismatch: {best['hypothesis']} ({best['meaning']}): mean acceptance length "
                   f"{base['mean_acceptance_length']:.2f} -> {best['mean_acceptance_length']:.2f}; fix: {best['fix']}")
    else:
        verdict = ("no convention mismatch found: every hypothesis accepts no better than the drafter as "
                   "configured; if acceptance is low, the drafter needs more or closer training data")
    return {"verdict": verdict, "mismatch": best["hypothesis"] if found else None, "baseline": base, "rows": rows,
            "k": k, "aux_layer_ids": configured_ids}
