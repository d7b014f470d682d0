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

from ..diagnose.stats import acceptance_length_se, differ, paired_difference, wilson

INTEGRATION, DRAFTER, OVERHEAD, HEALTHY = "integration", "drafter/data", "overhead", "healthy"
WEAK_BELOW = 1.5  # a reference acceptance length under this at k >= 3: the drafter itself is weak
CLEAR_WITHIN = 0.25  # acceptance length: a healthy verdict needs 3 standard errors of the difference under this


class Live:
    """A server's acceptance over doctor's requests, sent one at a time at temperature 0: /metrics
    is read before the first and after each, so the figures cover exactly these requests (as
    long as no other traffic runs) and each prompt's own figure is known for the paired test."""

    def __init__(self, url: str, *, max_tokens: int, model: str | None = None, api_key: str | None = None,
                 timeout: float = 300.0):
        from openai import OpenAI

        from ..diagnose.metrics import base_url, scrape_url

        self.url, self.max_tokens = url, max_tokens
        self.client = OpenAI(base_url=base_url(url) + "/v1", api_key=api_key or "EMPTY", timeout=timeout,
                             max_retries=2)
        self.model = model or self.client.models.list().data[0].id
        self.first = self.last = scrape_url(url)
        self.tokens, self.seconds = 0, 0.0
        self.per_prompt: list[float] = []  # each request's mean acceptance length

    def add(self, conversation) -> None:
        from ..diagnose.acceptance import summarize
        from ..diagnose.metrics import delta, scrape_url
        from ..evaluate import first_turn

        messages = first_turn(conversation.messages if hasattr(conversation, "messages") else conversation)
        t0 = time.perf_counter()
        r = self.client.chat.completions.create(model=self.model, messages=messages, temperature=0,
                                                max_tokens=self.max_tokens)
        self.seconds += time.perf_counter() - t0
        self.tokens += r.usage.completion_tokens if r.usage else 0
        now = scrape_url(self.url)
        acc, _ = summarize(delta(self.last, now))
        self.per_prompt.append(acc.mean_acceptance_length or 1.0)
        self.last = now

    def summary(self) -> dict:
        from ..diagnose.acceptance import summarize
        from ..diagnose.metrics import delta

        acc, _ = summarize(delta(self.first, self.last))
        return {"model": self.model, "completion_tokens": self.tokens, "seconds": self.seconds, "k": acc.k,
                "num_drafts": acc.num_drafts, "mean_acceptance_length": acc.mean_acceptance_length,
                "per_position_acceptance": acc.per_position, "counting": acc.counting,
                "per_prompt_acceptance_length": list(self.per_prompt)}


def measure(url: str, target, drafter, conversations, *, max_tokens: int, model: str | None = None,
            api_key: str | None = None, min_prompts: int = 3, progress: bool = False):
    """The server and the reference on the same prompts, one prompt at a time, until the
    comparison is clear (`clear`, after `min_prompts`) or the prompts run out.
    Returns (live summary, Reference, stopped early)."""
    from ..errors import SpecdecError
    from ..progress import progress_bar
    from .sweep import Reference

    conversations = list(conversations)
    live, reference, early = Live(url, max_tokens=max_tokens, model=model, api_key=api_key), None, False
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("server and reference", total=len(conversations), rate="")
        for n, conv in enumerate(conversations, 1):
            live.add(conv)
            now = live.summary()
            if not now["num_drafts"] or not now["k"]:
                raise SpecdecError(f"{url} counted no speculative steps for a request: is it serving with a "
                                   f"drafter? (vllm:spec_decode_num_drafts did not move)")
            if reference is None:
                reference = Reference(target, drafter, k=int(now["k"]), max_tokens=max_tokens)
            reference.add(conv)
            ref = reference.summary()
            bar.update(task, advance=1, rate=f"AL {now['mean_acceptance_length']:.2f} live, "
                                             f"{ref['mean_acceptance_length']:.2f} reference")
            if n >= min_prompts and n < len(conversations) and clear(compare(now, ref)):
                early = True
                break
    return live.summary(), reference, early


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
    paired = None
    if live.get("per_prompt_acceptance_length") and reference.get("per_prompt_acceptance_length"):
        diff, se = paired_difference([live["per_prompt_acceptance_length"]],
                                     [reference["per_prompt_acceptance_length"]], 1)
        paired = {"prompts": len(live["per_prompt_acceptance_length"]), "mean_difference": diff, "se": se}
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
    if paired and math.isfinite(paired["se"]):
        why += (f"; paired over {paired['prompts']} prompts, live - reference = {paired['mean_difference']:+.2f} "
                f"+/- {3 * paired['se']:.2f}")
    return {"verdict": verdict, "why": why, "live_al": la, "live_se": lse, "reference_al": ra, "reference_se": rse,
            "positions": rows, "paired": paired}


def clear(result: dict) -> bool:
    """Whether more prompts could change the verdict: an integration fault is beyond noise already,
    or the noise is small enough that a fault worth naming would have shown."""
    noise = math.sqrt(result["live_se"] ** 2 + result["reference_se"] ** 2)
    return result["verdict"] == INTEGRATION or 3 * noise < CLEAR_WITHIN


def _ci(rows: list[dict], i: int) -> str:
    if i >= len(rows):
        return "n/a"
    r = rows[i]
    return (f"{100 * r['live']:.0f}% [{100 * r['live_ci'][0]:.0f}-{100 * r['live_ci'][1]:.0f}] live vs "
            f"{100 * r['reference']:.0f}% [{100 * r['reference_ci'][0]:.0f}-{100 * r['reference_ci'][1]:.0f}]")


def explain(live: dict, target, drafter, reference) -> dict:
    """Which served-state hypothesis reproduces the live acceptance: each switch of the sweep
    walked over the reference's texts, the closest one within noise named."""
    from .sweep import Sweep

    sweep = Sweep(target, drafter, reference.k)
    for text in reference.texts:
        sweep.add(text)
    la = live["mean_acceptance_length"] or 1.0
    lse = acceptance_length_se(live.get("per_position_acceptance") or [], live.get("num_drafts") or 0)
    per_prompt = live.get("per_prompt_acceptance_length") or []
    rows = []
    for r in sweep.rows()[1:]:
        walked = [1 + sum(w.accepted) / len(w.accepted) if w.accepted else 1.0 for w in sweep.walks[r["hypothesis"]]]
        diff, se = paired_difference([per_prompt], [walked], 1) if len(per_prompt) == len(walked) else (0.0, math.inf)
        rows.append({"hypothesis": r["hypothesis"], "fix": r["fix"], "fed": r["fed"],
                     "mean_acceptance_length": r["mean_acceptance_length"], "se": r["se"],
                     "live_minus_hypothesis": diff, "paired_se": se,
                     "reproduces_live": not differ(r["mean_acceptance_length"], r["se"], la, lse, z=2.0)})
    # Among the switches whose figure the live one is within noise of, the closest prompt by prompt.
    matches = [r for r in rows if r["reproduces_live"]]
    best = min(matches, key=lambda r: abs(r["live_minus_hypothesis"]), default=None)
    return {"rows": rows, "match": best}
