"""The served-vs-trained state check: recompute, with the target as loaded now, the aux states of a
few samples of the capture the drafter was trained on, and compare them with what was stored.

A changed target (weights, quantization, dtype), the wrong layer, another chat template rendering
(the stored token ids are fed as they are, so a template change shows in the static checks, not
here) or a scale error each move these states; the drafter's fc output over them shows what the
drafter would see. Relative error per aux slot (layer id) is ||now - then|| / ||then|| over the
sample's tokens.
"""

from __future__ import annotations

import torch

# Stored states are bf16 by default: a rounding of ~0.4% per element, a little more through the
# target's layers in another dtype; past this the target (or the layer) is not the one trained on.
MAX_RELATIVE_ERROR = 0.05


def state_check(target, drafter, capture_dir, *, samples: int = 2) -> dict:
    from ..capture.store import CaptureStore

    store = CaptureStore(capture_dir)
    ids = list(store.manifest["aux_layer_ids"])
    old_ids = list(target.aux_layer_ids)
    target.set_aux_layer_ids(ids)
    H = target.hidden_size
    errors = torch.zeros(len(ids))
    fc_then = fc_now = 0.0
    n = min(samples, len(store))
    try:
        for i in range(n):
            s = store.sample(i, ("input_ids", "aux_hidden"))
            then = s["aux_hidden"].float().to(target.device)
            now = target.forward(s["input_ids"].long()[None].to(target.device)).aux_hidden[0].float()
            for slot in range(len(ids)):
                cols = slice(slot * H, (slot + 1) * H)
                errors[slot] += float((now[:, cols] - then[:, cols]).norm() / then[:, cols].norm().clamp_min(1e-12))
            with torch.no_grad():
                p = drafter.fc.weight
                fc_then += float(drafter.project_aux(then.to(p.dtype)).float().norm(dim=-1).mean())
                fc_now += float(drafter.project_aux(now.to(p.dtype)).float().norm(dim=-1).mean())
    finally:
        target.set_aux_layer_ids(old_ids)
    errors /= max(n, 1)
    per_id = {int(i): float(e) for i, e in zip(ids, errors)}
    bad = {i: e for i, e in per_id.items() if e > MAX_RELATIVE_ERROR}
    return {"capture": str(capture_dir), "samples": n, "aux_layer_ids": ids, "relative_error": per_id,
            "fc_output_norm_trained": fc_then / max(n, 1), "fc_output_norm_now": fc_now / max(n, 1), "ok": not bad,
            "detail": (f"the target's hidden states at ids {sorted(bad)} differ from the capture the drafter was "
                       f"trained on by {', '.join(f'{100 * e:.0f}%' for e in bad.values())} (relative): another "
                       f"target revision, quantization or layer than training used" if bad else
                       f"the target's states match the training capture (max relative error "
                       f"{100 * max(per_id.values(), default=0):.1f}% over {n} samples)")}
