"""The sweep: the drafter's acceptance under each hypothesis of what serving got wrong.

Every hypothesis is one run-time switch: the aux layer ids shifted by -1/+1 (an EAGLE vs
SpecForge/ModelOpt/SGLang id convention mixed up), the last state taken after the final norm
instead of before, `norm_before_residual` flipped, an identity vocab mapping (a lost or ignored
`d2t`), one aux state fed as zeros (what vLLM once fed for the last id of a DeepSeek/Kimi target),
and the weights rescaled to the norms training recorded. All are measured on the reference's own
text (`walk`: what the engine would count under the switch, without generating again), on the
same positions as the drafter as configured, so each comparison is paired. A hypothesis names the
mismatch only when it beats the drafter as configured by more than the noise of that paired
difference (`specdec.diagnose.stats`); and each row says whether the switch moves acceptance at
all on this target, since a one-layer shift of a 30-layer target's taps may not, and then a sweep
that finds nothing is no evidence of health. Prompts are added one at a time until every row is
clear either way or the prompts run out.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from ..diagnose.stats import acceptance_length_se, mcnemar_z, paired_difference
from ..engine.engine import SpeculativeEngine
from .walk import Text, Walk, capture_text, neighbour_ids, summary, walk_text

MIN_GAIN = 0.15  # acceptance length a hypothesis must add, beyond noise, to be named
Z_DECIDE = 3.0  # standard errors of a paired difference that count as a move


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


class Reference:
    """The drafter as configured, in specdec's engine, one prompt at a time: the engine's own
    counters (the reference a server is held to) and the text each hypothesis is walked over."""

    def __init__(self, target, drafter, *, k: int, max_tokens: int):
        from ..engine.api import SamplingParams

        self.target, self.drafter, self.k = target, drafter, k
        self.engine = SpeculativeEngine(target, drafter=drafter, k=k)
        self.params = SamplingParams(max_new_tokens=max_tokens)
        self.ids = neighbour_ids(target, drafter)
        self.results: list = []
        self.texts: list[Text] = []

    def add(self, conversation) -> None:
        from ..data.chat import prompt_ids
        from ..evaluate import first_turn

        messages = conversation.messages if hasattr(conversation, "messages") else conversation
        prompt = prompt_ids(self.target.tokenizer, first_turn(messages))
        result = self.engine.generate(prompt, self.params)
        self.results.append(result)
        self.texts.append(capture_text(self.target, prompt, result.token_ids, self.ids))

    def summary(self) -> dict:
        from ..evaluate import summarize

        s = summarize(self.results, self.k)
        return {**{key: s[key] for key in ("k", "num_drafts", "mean_acceptance_length", "per_position_acceptance",
                                           "accepted_per_position", "new_tokens")},
                "per_prompt_acceptance_length": [r.mean_acceptance_length for r in self.results]}


class Sweep:
    """Every hypothesis walked over each text the reference adds (`walk`); rows compare each with
    the drafter as configured on the same positions (a paired comparison)."""

    BASE = "as configured"

    def __init__(self, target, drafter, k: int):
        self.target, self.drafter, self.k = target, drafter, k
        self.walks: dict[str, list[Walk]] = {self.BASE: []}
        self.fed: dict[str, str] = {}  # what the drafter reads under each switch that applies
        for h in HYPOTHESES:
            with switched(h, target, drafter) as applies:
                if applies:
                    self.walks[h.name] = []
                    self.fed[h.name] = h.fed(list(drafter.cfg.aux_layer_ids))

    def add(self, text: Text) -> None:
        self.walks[self.BASE].append(walk_text(self.target, self.drafter, text, self.k))
        for h in HYPOTHESES:
            if h.name in self.walks:
                with switched(h, self.target, self.drafter):
                    self.walks[h.name].append(walk_text(self.target, self.drafter, text, self.k))

    def rows(self) -> list[dict]:
        base = self.walks[self.BASE]
        base_m = summary(base, self.k)
        rows = [{"hypothesis": self.BASE, **base_m, "se": _se(base_m)}]
        for h in HYPOTHESES:
            if h.name not in self.walks:
                continue
            walks = self.walks[h.name]
            m = summary(walks, self.k)
            diff, se = paired_difference([w.depth for w in walks], [w.depth for w in base], 2 * self.k)
            # The first draft at each position, right under one and wrong under the other.
            pairs = [(hd > 0, bd > 0) for hw, bw in zip(walks, base) for hd, bd in zip(hw.depth, bw.depth)]
            better, worse = sum(h and not b for h, b in pairs), sum(b and not h for h, b in pairs)
            z = mcnemar_z(better, worse)
            delta = m["mean_acceptance_length"] - base_m["mean_acceptance_length"]
            rows.append({"hypothesis": h.name, "meaning": h.meaning, "fix": h.fix, "fed": self.fed[h.name],
                         **m, "se": _se(m), "delta": delta, "paired_difference": diff, "paired_se": se,
                         "first_draft_better": better, "first_draft_worse": worse, "paired_z": z,
                         "changes_acceptance": (abs(z) > Z_DECIDE or abs(diff) > Z_DECIDE * se)
                         and abs(delta) > 0.05})
        return rows

    def decided(self) -> bool:
        """Every row is clear: it moves acceptance beyond noise, or the paired noise is so small
        that a move worth naming would have shown."""
        return all(r["changes_acceptance"] or Z_DECIDE * r["paired_se"] < MIN_GAIN / 2 for r in self.rows()[1:])


def _se(row: dict) -> float:
    n = row.get("num_drafts")
    return acceptance_length_se(row.get("per_position_acceptance") or [], n) if n else 0.0


def run_sweep(target, drafter, conversations, *, k: int, max_tokens: int, min_prompts: int = 3,
              progress: bool = False) -> tuple[Reference, Sweep, bool]:
    """The reference and the sweep, prompt by prompt, until the sweep has decided (after
    `min_prompts`) or the prompts run out. Returns (reference, sweep, stopped early)."""
    from ..progress import progress_bar

    conversations = list(conversations)
    reference, sweep = Reference(target, drafter, k=k, max_tokens=max_tokens), Sweep(target, drafter, k)
    early = False
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("reference and sweep", total=len(conversations), rate="")
        for n, conv in enumerate(conversations, 1):
            reference.add(conv)
            sweep.add(reference.texts[-1])
            ref = reference.summary()
            bar.update(task, advance=1, rate=f"AL {ref['mean_acceptance_length']:.2f} over {ref['num_drafts']} steps")
            if n >= min_prompts and n < len(conversations) and sweep.decided():
                early = True
                break
    return reference, sweep, early


def diagnose_drafter(target, drafter, conversations, *, k: int = 5, max_new_tokens: int = 48,
                     min_prompts: int = 3, progress: bool = False) -> dict:
    """Acceptance under each hypothesis, as `run_sweep` measures it, and the verdict."""
    reference, sweep, early = run_sweep(target, drafter, conversations, k=k, max_tokens=max_new_tokens,
                                        min_prompts=min_prompts, progress=progress)
    base = reference.summary()
    rows = sweep.rows()
    base_al, base_se = base["mean_acceptance_length"], _se(base)
    candidates = [r for r in rows[1:] if r["hypothesis"] not in PROBES]
    best = max(candidates, key=lambda r: r["mean_acceptance_length"], default=None)
    found = (best is not None and best["changes_acceptance"] and best["delta"] > MIN_GAIN
             and best["mean_acceptance_length"] > 1.2 * rows[0]["mean_acceptance_length"])
    blind = [r["hypothesis"] for r in rows[1:] if not r["changes_acceptance"]]
    measured = (f"{len(reference.texts)} prompts, {base['num_drafts']} steps at k = {k}"
                + (", stopped when every row was clear" if early else ""))
    noise = f" (+/- {3 * base_se:.2f} at 3 standard errors)"
    if found:
        verdict = (f"likely mismatch: {best['hypothesis']} ({best['meaning']}): mean acceptance length "
                   f"{base_al:.2f}{noise} -> {best['mean_acceptance_length']:.2f}; fix: {best['fix']}")
    else:
        verdict = (f"no convention mismatch found: no hypothesis beats the drafter as configured "
                   f"({base_al:.2f}{noise}) by more than the noise")
        if blind:
            verdict += (f"; on this target {', '.join(blind)} do not change acceptance measurably, so such a "
                        f"fault would not show here")
    verdict += f"; measured on {measured}"
    return {"verdict": verdict, "mismatch": best["hypothesis"] if found else None, "baseline": base, "rows": rows,
            "k": k, "aux_layer_ids": list(drafter.cfg.aux_layer_ids), "insensitive": blind,
            "prompts": len(reference.texts), "stopped_early": early,
            "baseline_se": base_se if math.isfinite(base_se) else None}
