"""A live server against the reference: the same prompts, greedy, through the server's API and
through specdec's engine with the same drafter at the server's k.

Greedy speculative decoding is lossless, so both produce the same text; the drafter then sees the
same contexts, and its acceptance can only differ if the server feeds it something else than the
engine does (other hidden states, another vocab mapping, another norm), or if the server runs
another drafter. Live acceptance is read from /metrics counter deltas over exactly these requests,
as `diagnose` reads them, so any vLLM, SGLang or specdec server works.
"""

from __future__ import annotations

import math
import time

from ..diagnose.stats import acceptance_length_se, differ, wilson

INTEGRATION, DRAFTER, OVERHEAD, HEALTHY = "integration", "drafter/data", "overhead", "healthy"
WEAK_BELOW = 1.5  # a reference acceptance length under this at k >= 3: the drafter itself is weak


def send_prompts(url: str, model: str | None, conversations, *, max_tokens: int, api_key: str | None = None,
                 timeout: float = 300.0) -> tuple[str, int]:
    """Each conversation's first user turn through /v1/chat/completions at temperature 0.
    Returns (the model name used, completion tokens)."""
    from openai import OpenAI

    from ..diagnose.metrics import base_url
    from ..evaluate import first_turn

    client = OpenAI(base_url=base_url(url) + "/v1", api_key=api_key or "EMPTY", timeout=timeout, max_retries=2)
    if model is None:
        model = client.models.list().data[0].id
    tokens = 0
    for c in conversations:
        messages = first_turn(c.messages if hasattr(c, "messages") else c)
        r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
        tokens += r.usage.completion_tokens if r.usage else 0
    return model, tokens


def measure_live(url: str, conversations, *, max_tokens: int, model: str | None = None,
                 api_key: str | None = None) -> dict:
    """Acceptance of the server over these requests only (counter deltas before/after)."""
    from ..diagnose.acceptance import summarize
    from ..diagnose.metrics import delta, scrape_url

    before = scrape_url(url)
    t0 = time.perf_counter()
    model, tokens = send_prompts(url, model, conversations, max_tokens=max_tokens, api_key=api_key)
    seconds = time.perf_counter() - t0
    acc, _ = summarize(delta(before, scrape_url(url)))
    return {"model": model, "completion_tokens": tokens, "seconds": seconds, "k": acc.k,
            "num_drafts": acc.num_drafts, "mean_acceptance_length": acc.mean_acceptance_length,
            "per_position_acceptance": acc.per_position, "counting": acc.counting}


def measure_reference(target, drafter, conversations, *, k: int, max_tokens: int, progress: bool = False) -> dict:
    from .sweep import measure_engine

    return measure_engine(target, drafter, target.tokenizer, conversations, k=k, max_tokens=max_tokens,
                          progress=progress)


def _intervals(m: dict) -> list[tuple[float, float]]:
    n = m.get("num_drafts") or 0
    return [wilson(p * n, n) for p in (m.get("per_position_acceptance") or [])]


def compare(live: dict, reference: dict, *, heldout_al: float | None = None) -> dict:
    """The verdict on live vs reference acceptance, with the evidence per position."""
    la, ra = live["mean_acceptance_length"] or 1.0, reference["mean_acceptance_length"]
    lse = acceptance_length_se(live.get("per_position_acceptance") or [], live.get("num_drafts") or 0)
    rse = acceptance_length_se(reference["per_position_acceptance"], reference["num_drafts"])
    rows = []
    below = []
    for i, (lp, rp, li, ri) in enumerate(zip(live.get("per_position_acceptance") or [],
                                               reference["per_position_acceptance"], _intervals(live),
                                               _intervals(reference))):
        apart = li[1] < ri[0]
        below.append(apart)
        rows.append({"position": i, "live": lp, "live_ci": li, "reference": rp, "reference_ci": ri,
                     "live_below_reference": apart})
    # Position 0 alone (a binomial over every step) is the most powerful evidence; the whole
    # length is tested too, at 3 combined standard errors.
    first_below = bool(below) and below[0]
    if la < ra and (first_below or differ(la, lse, ra, rse)):
        verdict = INTEGRATION
        why = (f"the server accepts {la:.2f} tokens per step where the same drafter on the same prompts accepts "
               f"{ra:.2f} in specdec's engine; position 0 {_ci(rows, 0)} (95% intervals apart): the server feeds "
               f"the drafter something else than training did")
    elif ra < WEAK_BELOW:
        verdict = DRAFTER
        held = (f"; on held-out training answers it walked {heldout_al:.2f} at k = 5, so the served prompts differ "
                f"from the training data (domain or chat template)" if heldout_al and heldout_al > ra + 0.3
                else "; it accepts little on held-out training answers too: it needs more or closer training"
                if heldout_al else "")
        why = f"the server matches the reference ({la:.2f} vs {ra:.2f}), and both are low{held}"
    else:
        verdict = HEALTHY
        noise = math.sqrt(lse * lse + rse * rse)
        why = (f"the server accepts as the reference does ({la:.2f} vs {ra:.2f}, a difference within "
               f"{3 * noise:.2f}, 3 standard errors)")
    return {"verdict": verdict, "why": why, "live_al": la, "live_se": lse, "reference_al": ra, "reference_se": rse,
            "positions": rows}


def _ci(rows: list[dict], i: int) -> str:
    if i >= len(rows):
        return "n/a"
    r = rows[i]
    return (f"{100 * r['live']:.0f}% [{100 * r['live_ci'][0]:.0f}-{100 * r['live_ci'][1]:.0f}] live vs "
            f"{100 * r['reference']:.0f}% [{100 * r['reference_ci'][0]:.0f}-{100 * r['reference_ci'][1]:.0f}]")


def explain(live: dict, target, drafter, conversations, *, k: int, max_tokens: int) -> dict | None:
    """Which served-state hypothesis reproduces the live acceptance: the reference rerun under
    each switch of the sweep, the closest one within noise named."""
    from .sweep import HYPOTHESES, _se, switched

    la = live["mean_acceptance_length"] or 1.0
    lse = acceptance_length_se(live.get("per_position_acceptance") or [], live.get("num_drafts") or 0)
    rows = []
    for h in HYPOTHESES:
        with switched(h, target, drafter) as applies:
            if not applies:
                continue
            m = measure_reference(target, drafter, conversations, k=k, max_tokens=max_tokens)
            fed = h.fed(list(drafter.cfg.aux_layer_ids))
        rows.append({"hypothesis": h.name, "fix": h.fix, "mean_acceptance_length": m["mean_acceptance_length"],
                     "se": _se(m), "fed": fed})
    target.set_aux_layer_ids(drafter.cfg.aux_layer_ids)
    matches = [r for r in rows if not differ(r["mean_acceptance_length"], r["se"], la, lse, z=2.0)]
    best = min(matches, key=lambda r: abs(r["mean_acceptance_length"] - la), default=None)
    return {"rows": rows, "match": best}
