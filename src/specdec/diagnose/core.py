"""`diagnose` end to end: read a source, take counter deltas over a window, judge, return a dict.

The dict is the `--json` output and what the pretty view and `specdec report` read, so every
figure the user sees exists in exactly one place.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from typing import Callable

from .. import __version__
from ..errors import SpecdecError
from . import metrics as m
from .acceptance import Acceptance, summarize
from .verdict import FAR_BELOW, HEALTHY, LOSES, MARGINAL, PUBLISHED_EAGLE3, Reference, judge

DEFAULT_WINDOW_S = 10.0
_RANK = {FAR_BELOW: 0, LOSES: 1, MARGINAL: 2, HEALTHY: 3}
PROBLEMS = (FAR_BELOW, LOSES)  # verdicts `diagnose` exits 1 on


def _check_live(scrape: m.Scrape) -> None:
    if scrape.engine == "sglang" and not any(s.accept_length for s in scrape.sglang.values()):
        raise SpecdecError(
            f"SGLang at {scrape.source} reports spec_accept_length 0: no speculative step has been "
            "logged yet; send some traffic and re-run (or speculative decoding is disabled)"
        )


def _no_drafts(acc: Acceptance) -> bool:
    return not acc.num_drafts and not acc.num_draft_tokens and acc.counting != "sglang"


def _require_k(acc: Acceptance, source: str) -> None:
    if acc.k is None and (acc.num_draft_tokens or acc.mean_acceptance_length):
        raise SpecdecError(
            f"k (drafts per step) is unknown for {source}: the metrics have no "
            "vllm:spec_decode_num_drafts counter or per-position series (vLLM v0 or an early v1); "
            "pass --k with the server's num_speculative_tokens"
        )


def _block(acc: Acceptance, cost_ratio: float | None, reference: Reference | None = None) -> dict:
    return {**acc.as_dict(), **judge(acc, cost_ratio=cost_ratio, reference=reference).as_dict()}


def drafter_reference(folder: str) -> Reference:
    """The acceptance `specdec train` recorded for a drafter on its held-out answers (k = 5)."""
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecdecError(f"cannot read {path} ({e}): expected a drafter folder written by specdec") from None
    held = (((raw.get("specdec") or {}) if isinstance(raw, dict) else {}).get("provenance") or {}).get("heldout") or {}
    al = held.get("walked_acceptance_length_k5")
    if not al:
        raise SpecdecError(f"{folder} records no held-out acceptance (trained elsewhere or by an older specdec): "
                           f"drop --drafter to compare with published EAGLE-3 figures instead")
    return Reference(float(al), 5, f"this drafter on its held-out training answers ({al:.2f} at k = 5)")


def _compact(acc: Acceptance) -> dict:
    keys = (
        "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
        "mean_acceptance_length", "k", "per_position_acceptance", "per_position_conditional",
    )
    d = acc.as_dict()
    return {key: d[key] for key in keys}


def diagnose(
    source: str,
    *,
    window: float = DEFAULT_WINDOW_S,
    cost_ratio: float | None = None,
    k: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
    reference: Reference | None = None,
) -> dict:
    """Diagnose a /metrics URL (two scrapes `window` seconds apart), a saved file, or `-` (stdin).

    Returns the JSON-ready result: the aggregate's figures and verdict at the top level, one block
    per label set under `per_label_set`, and cumulative figures under `totals_since_start`.
    """
    if cost_ratio is not None and not (0 <= cost_ratio < 10):
        raise SpecdecError(f"--cost-ratio {cost_ratio} is out of range: expected 0 <= c < 10, e.g. 0.05")
    if k is not None and k < 1:
        raise SpecdecError(f"--k {k} is invalid: expected the number of draft tokens per step (>= 1)")
    throughput = None
    window_s = None
    if m.is_url(source):
        first = m.scrape_url(source)
        sleep(max(window, 0.0))
        second = m.require_spec(m.scrape_url(source))
        _check_live(second)
        window_s = max(second.taken_at - first.taken_at, 1e-9)
        current = m.delta(first, second)
        totals = second
        basis = "window" if current.engine != "sglang" else "latest SGLang log interval (gauges)"
        gen = current.total_generation_tokens
        if gen is not None:
            throughput = gen / window_s
        elif current.gen_throughput_gauge is not None:
            throughput = current.gen_throughput_gauge
    else:
        current = totals = m.require_spec(m.load_source(source))
        _check_live(current)
        basis = (
            "latest SGLang log interval (gauges, saved scrape)"
            if current.engine == "sglang"
            else "totals since start (saved scrape)"
        )

    overall, parts = summarize(current, k=k)
    total_overall, _ = summarize(totals, k=k)
    notes = []
    if basis == "window" and _no_drafts(overall):
        if _no_drafts(total_overall):
            raise SpecdecError(
                f"{current.source} has spec-decode counters but no drafts yet: send traffic to the "
                "server (speculation runs only while it decodes) and re-run"
            )
        notes.append(
            f"no drafts during the {window_s:.1f} s window (idle server?): judged on totals since start"
        )
        overall, parts = total_overall, summarize(totals, k=k)[1]
        basis = "totals since start (idle window)"
    elif basis != "window" and _no_drafts(overall):
        raise SpecdecError(
            f"{current.source} has spec-decode counters but they are all zero: the server had not "
            "drafted anything when this was saved; send traffic first"
        )
    _require_k(overall, current.source)
    if reference is None and (current.mode_hint or "eagle").startswith("eagle"):
        reference = PUBLISHED_EAGLE3  # labelled as such; an n-gram or plain server gets none

    result = {
        "source": current.source,
        "engine": current.engine,
        "basis": basis,
        "window_s": window_s,
        **_block(overall, cost_ratio, reference),
        "throughput_tokens_per_s": throughput,
        "per_label_set": [_block(p, cost_ratio, reference) for p in parts] if len(parts) > 1 else [],
        "reference": None if reference is None else {"acceptance_length": reference.mean_acceptance_length,
                                                     "k": reference.k, "label": reference.label},
        "totals_since_start": None,
        "specdec_version": __version__,
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    for block in result["per_label_set"]:
        if _RANK.get(block["verdict"], 0) < _RANK.get(result["verdict"], 0):
            labels = m.format_labels(block["labels"])
            notes.append(
                f"{labels}: {block['headline']} (the aggregate hides it; see its own section)"
            )
    result["reasons"] = notes + result["reasons"]
    if totals.engine == "sglang":
        info = totals.server_info_accept_length
        result["totals_since_start"] = (
            {"mean_acceptance_length": info, "source": "/get_server_info avg_spec_accept_length"}
            if info
            else None
        )
    else:
        result["totals_since_start"] = _compact(total_overall)
    return _finite(result)


def _finite(obj):
    """NaN/inf become None so `--json` stays valid JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj
