"""How a drafter starts training: sized for the target with a draft vocab counted from the data
(or loaded with `--init` to fine-tune), its embedding a frozen copy of the target's, and its layer
random or copied from one of the target's layers (`TrainConfig.init_layer`)."""

from __future__ import annotations


import torch
from torch import nn

from ..errors import SpecdecError
from ..models.drafter import DrafterConfig, Eagle3Drafter
from .vocab import build_draft_vocab, count_tokens, coverage
from .config import TrainConfig


FROZEN = "embed_tokens.weight"  # the drafter's one frozen tensor, a copy of the target's


def copy_target_embedding(drafter: Eagle3Drafter, target) -> None:
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.embed_tokens().weight.float().cpu())


def make_drafter(target, source, cfg: TrainConfig, init: str | None) -> tuple[Eagle3Drafter, dict]:
    """A new drafter sized for the target with a vocab from the data, or `--init` fine-tuning."""
    from ..models.formats import load_drafter

    info = {}
    masked, every = count_tokens(source.token_samples(), target.vocab_size)
    if init:
        drafter = load_drafter(init, target, dtype=torch.float32, device="cpu")
        if cfg.rebuild_vocab:
            ids = build_draft_vocab(masked, drafter.cfg.draft_vocab_size, every, target.eos_token_ids)
            drafter.set_vocab_mapping(ids)
            info["vocab"] = "rebuilt from data (--rebuild-vocab): lm_head rows re-learn from scratch"
        else:
            info["vocab"] = f"kept from {init} (d2t unchanged)"
    else:
        dcfg = DrafterConfig.for_target(target.config, draft_vocab_size=cfg.draft_vocab_size,
                                        aux_layer_ids=target.aux_layer_ids,
                                        norm_before_residual=cfg.norm_before_residual,
                                        **({"intermediate_size": cfg.intermediate_size}
                                           if cfg.intermediate_size else {}))
        torch.manual_seed(cfg.seed)
        drafter = Eagle3Drafter(dcfg)
        copy_target_embedding(drafter, target)
        with torch.no_grad():
            ids = build_draft_vocab(masked, dcfg.draft_vocab_size, every, target.eos_token_ids)
            drafter.set_vocab_mapping(ids)
            # Start the output head where the target's is: same final norm, same rows.
            drafter.lm_head.weight.copy_(target.lm_head().weight[ids.to(target.device)].float().cpu())
            norm = target.final_norm()
            if norm is not None and norm.weight.shape == drafter.norm.weight.shape:
                drafter.norm.weight.copy_(norm.weight.float().cpu())
        info["init_layer"] = start_layer(drafter, target, cfg.init_layer, cfg.init_embed_half)
        info["vocab"] = f"built from {int(masked.sum())} assistant tokens"
    info["vocab_coverage"] = coverage(masked, drafter.draft_to_target.cpu())
    return drafter, info


def start_layer(drafter: Eagle3Drafter, target, choice: str | int, embed_half: str = "zero") -> str:
    """Apply `TrainConfig.init_layer`; returns what the drafter's layer started from.

    "auto" takes the target layer that reads the top aux state (it starts closer to what the
    drafter must compute than a random layer, and ends with higher acceptance;
    benchmarks/drafter_recipes.py), and a random layer where the target's layers have another
    shape (MLA, MoE).
    """
    if choice in (None, "none"):
        return "random"
    if choice == "auto":
        index = min(target.aux_layer_ids[-1], target.num_layers - 1)
        try:
            return init_layer_from_target(drafter, target, index, embed_half)
        except SpecdecError as e:
            return f"random (target layer {index} does not fit: {e})"
    return init_layer_from_target(drafter, target, int(choice), embed_half)


@torch.no_grad()
def init_layer_from_target(drafter: Eagle3Drafter, target, index: int, embed_half: str = "zero") -> str:
    """Start the drafter's one layer as the target's decoder layer `index`, reading the top aux state.

    fc passes the highest aux state through unchanged, and the attention's hidden-state columns,
    o_proj, the MLP and the norms are the target layer's, so with index = the top aux id the
    drafter starts as exactly the computation the target does next. The columns that read the next
    token's embedding start at zero ("zero") or as a second copy ("copy"): they are what the drafter
    must learn, since the target never reads a token one position ahead. An MLP of another width
    (--intermediate-size) stays random.
    """
    if not -target.num_layers <= index < target.num_layers:
        raise SpecdecError(f"--init-layer {index}: the target has {target.num_layers} decoder layers; "
                           f"give 0..{target.num_layers - 1} or a negative index (-1 = the last)")
    src = target.layers[index]
    mid, h, tH = drafter.midlayer, drafter.cfg.hidden_size, drafter.cfg.target_hidden_size
    attn, sattn = mid.self_attn, getattr(src, "self_attn", None)
    weights = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w = getattr(getattr(sattn, name, None), "weight", None)
        want = getattr(attn, name).weight.shape
        want = want if name == "o_proj" else (want[0], want[1] // 2)
        if w is None or tuple(w.shape) != tuple(want) or h != tH:
            found = "missing" if w is None else tuple(w.shape)
            raise SpecdecError(f"{name} of target layer {index} is {found}; the drafter needs {tuple(want)}")
        weights[name] = w.float().cpu()
    norms = {}
    for name in ("input_layernorm", "post_attention_layernorm"):
        w = getattr(getattr(src, name, None), "weight", None)
        if w is None or tuple(w.shape) != (h,):
            raise SpecdecError(f"{name} of target layer {index} is {'missing' if w is None else tuple(w.shape)}; "
                               f"the drafter needs ({h},)")
        norms[name] = w.float().cpu()
    # Everything checked: from here on the drafter is written.
    for name in ("q_proj", "k_proj", "v_proj"):
        dst = getattr(attn, name).weight
        dst[:, h:] = weights[name]
        dst[:, :h] = weights[name] if embed_half == "copy" else 0.0
    attn.o_proj.weight.copy_(weights["o_proj"])
    for norm in (mid.hidden_norm, mid.input_layernorm):
        norm.weight.copy_(norms["input_layernorm"])
    mid.post_attention_layernorm.weight.copy_(norms["post_attention_layernorm"])
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -tH:] = torch.eye(h, tH)  # aux states come in canonical (ascending) order
    theirs, ours = getattr(src, "mlp", nn.Module()).state_dict(), mid.mlp.state_dict()
    if theirs.keys() == ours.keys() and all(theirs[k].shape == ours[k].shape for k in ours):
        mid.mlp.load_state_dict({k: v.float().cpu() for k, v in theirs.items()})
        return f"target layer {index}"
    return f"target layer {index} (attention and norms; the MLP's shape differs, random)"
