"""Static checks: what can be known of a drafter folder and its target before anything runs.

Each check is ok, a warning, or a failure with the fix. They cover the faults no acceptance sweep
can find: a lost vocab mapping, engine keys that disagree with the ids the drafter was trained
on (read by each engine's rules, `specdec.engine_rules`), a drafter for another target, and,
against the provenance `train` recorded, a changed chat template or tokenizer, changed target
weights, and weights scaled after training.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _vocab_checks(cfg, d2t: torch.Tensor, t2d: torch.Tensor | None, folder: Path) -> list[Check]:
    out = []
    reduced = cfg.draft_vocab_size < cfg.vocab_size
    if reduced and not bool(d2t.any()):
        kept = t2d.nonzero().flatten() if t2d is not None else None
        rebuild = kept is not None and kept.numel() == cfg.draft_vocab_size and bool(kept[-1] >= cfg.draft_vocab_size)
        out.append(Check(
            "vocab mapping", FAIL,
            f"d2t is all zeros with a reduced draft vocab ({cfg.draft_vocab_size} of {cfg.vocab_size}): every draft "
            f"id i is served as target id i, the mapping is lost"
            + (f"; t2d still marks the {kept.numel()} target ids the draft vocab kept" if rebuild else ""),
            f"specdec convert {folder} OUT   (rebuilds d2t from t2d)" if rebuild
            else "find the vocab mapping the drafter was trained with (d2t) and re-export"))
        return out
    if t2d is not None and reduced:
        targets = torch.arange(cfg.draft_vocab_size) + d2t
        if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[targets].all()):
            out.append(Check("vocab mapping", WARN, "t2d disagrees with d2t (engines read only d2t)",
                             f"specdec export --drafter {folder} OUT   (rewrites t2d from d2t)"))
            return out
    out.append(Check("vocab mapping", OK, "identity at full vocab" if not reduced
                     else f"d2t maps {cfg.draft_vocab_size} draft ids to target ids in range"))
    return out


def _provenance_checks(cfg, drafter, target) -> list[Check]:
    from ..capture.store import tokenizer_fingerprint

    prov = cfg.provenance or {}
    if not prov:
        return [Check("provenance", WARN, "the drafter records no training provenance (trained elsewhere or by an "
                      "older specdec): template, target-weight and scale checks skipped",
                      "retrain with specdec train, or compare by hand")]
    tok = getattr(target, "tokenizer", None)
    now = {"tokenizer_fingerprint": tokenizer_fingerprint(tok, target.eos_token_ids) if tok is not None else None,
           "target_fingerprint": target.fingerprint() if hasattr(target, "fingerprint") else None}
    # (what, key, status when it changed, what a change means, the fix, the ok detail)
    compared = [
        ("chat template and tokenizer", "tokenizer_fingerprint", FAIL,
         "the target's chat template, vocab or end tokens changed since training: prompts render differently "
         "from the text the drafter learned",
         "serve with the chat template training used, or regenerate and retrain with this one", "as in training"),
        ("target weights", "target_fingerprint", WARN,
         "the target differs from the one trained against: another revision, a fine-tune or a quantization "
         "changes the hidden states the drafter reads",
         "serve the target the drafter was trained for, or retrain on this one", "the target trained against"),
    ]
    out = []
    for name, key, status, changed, fix, same in compared:
        if prov.get(key) and now[key]:
            out.append(Check(name, OK, same) if now[key] == prov[key] else
                       Check(name, status, f"{changed} (fingerprint {prov[key]} then, {now[key]} now)", fix))
    recorded = prov.get("weight_norms") or {}
    if recorded:
        now = drafter.weight_norms()
        off = {n: now[n] / v for n, v in recorded.items() if n in now and v and abs(now[n] / v - 1) > 0.05}
        if off:
            worst = max(off, key=lambda n: abs(off[n] - 1))
            out.append(Check("drafter weights", FAIL,
                             f"{len(off)} tensor(s) differ in scale from what training saved: {worst} is "
                             f"{off[worst]:.3g}x its trained norm (a scale or conversion error: nothing errors, "
                             f"acceptance collapses)",
                             "re-export the drafter from its training run (specdec export --drafter RUN/drafter)"))
        else:
            out.append(Check("drafter weights", OK, "norms as training saved them"))
    return out


def static_checks(folder: str | Path, target,
                  engines: tuple[str, ...] = ("vllm", "sglang")) -> tuple[list[Check], object]:
    """(checks, the drafter as specdec loads it, or None when it cannot be loaded)."""
    from ..engine_rules import TargetFacts, read_folder
    from ..errors import SpecdecError
    from ..models.formats import load_drafter

    folder = Path(folder)
    checks: list[Check] = []
    try:
        drafter = load_drafter(folder, target, device="cpu", dtype=torch.float32)
    except SpecdecError as e:
        checks.append(Check("fits the target", FAIL, str(e),
                            "serve the drafter with the target it was trained for, or train one for this target"))
        return checks, None
    cfg = drafter.cfg
    checks.append(Check("fits the target", OK, f"hidden size {cfg.target_hidden_size}, vocab {cfg.vocab_size}, "
                        f"ids {list(cfg.aux_layer_ids)} within {target.num_layers} layers"))
    ids = list(cfg.aux_layer_ids)
    if ids != sorted(set(ids)):
        checks.append(Check("aux id order", FAIL if len(set(ids)) < len(ids) else WARN,
                            f"aux ids {ids} are not ascending and distinct: engines feed each layer once, in layer "
                            f"order", f"specdec export --drafter {folder} OUT   (reorders fc to layer order)"))
    recorded = (cfg.target_model_type, cfg.target_num_layers)
    now = (getattr(target.config, "model_type", None), target.num_layers)
    if all(recorded) and recorded != now:
        checks.append(Check("target architecture", FAIL, f"trained for a {recorded[1]}-layer {recorded[0]} target, "
                            f"served with a {now[1]}-layer {now[0]}", "use the target the drafter was trained for"))
    # load_drafter keeps the file's t2d, or derives it from d2t when the file has none.
    checks += _vocab_checks(cfg, drafter.d2t.cpu(), drafter.t2d.cpu(), folder)
    raw = json.loads((folder / "config.json").read_text())
    readings = read_folder(folder, TargetFacts.of(target), (cfg, drafter.d2t.cpu()), engines)
    for engine, r in readings.items():
        if r.ok:
            checks.append(Check(f"{r.name} reading", OK, r.verdict(ids)))
        else:
            fix = (f"specdec export --drafter {folder} --target TARGET --for {engine} OUT" if "specdec" in raw
                   else f"specdec convert {folder} OUT --target TARGET --for {engine}")
            checks.append(Check(f"{r.name} reading", FAIL, r.verdict(ids), fix))
    checks += _provenance_checks(cfg, drafter, target)
    return checks, drafter


def capture_check(target, drafter, capture_dir) -> tuple[Check, dict]:
    """The served-vs-trained state check (doctor/states.py) as one check."""
    from .states import state_check

    r = state_check(target, drafter, capture_dir)
    return Check("hidden states vs training capture", OK if r["ok"] else FAIL, r["detail"],
                 None if r["ok"] else "serve the target (revision, dtype, layers) the capture was made with"), r
