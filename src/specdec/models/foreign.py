"""Drafters written by other tools (the EAGLE reference, SpecForge, speculators), read into
specdec's `Eagle3Drafter`: their files (safetensors only; pickles refused unopened), their tensor
names (wrapper prefixes removed, speculators' layers.0.* -> midlayer.*), which tool wrote them,
and the aux layer ids they declare and in which convention (`specdec convert` drives this).
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_CONVENTION = {"eagle": "eagle", "specforge": "specforge", "speculators": "speculators", "specdec": "eagle"}
# Wrapper prefixes that training frameworks add around the drafter's own names.
_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "draft_model.", "model.", "ea_layer.")
_DROP = ("verifier_lm_head.", "verifier_norm.", "rotary_emb.", "target_model.", "target_lm_head.")
_KNOWN = ("fc.", "midlayer.", "norm.", "lm_head.", "embed_tokens.", "input_norm.", "fc_norm.")


def read_source(src: Path) -> tuple[Path, dict, dict]:
    """(folder, config.json, tensors) of SRC; refuses pickles without opening them."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..errors import SpecdecError
    from .formats import PICKLE_SUFFIXES, read_tensors, pickle_refusal

    if not src.exists():
        raise SpecdecError(f"no such drafter: {src}; expected a folder with config.json and *.safetensors")
    if src.is_file():
        if src.suffix in PICKLE_SUFFIXES:
            raise pickle_refusal(src)
        if src.suffix != ".safetensors":
            raise SpecdecError(f"{src} is not a .safetensors file: expected a drafter folder or its .safetensors file")
        folder = src.parent
        try:
            tensors = load_file(str(src))
        except (SafetensorError, OSError, ValueError) as e:
            raise SpecdecError(f"could not read {src}: {e}; the file looks truncated or corrupt") from e
    else:
        folder = src
        tensors = read_tensors(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise SpecdecError(f"no config.json next to {src}: expected the drafter's config (hidden size, heads, vocab)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{cfg_file} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise SpecdecError(f"{cfg_file} holds a JSON {type(raw).__name__}: expected an object")
    return folder, raw, tensors


def normalize_names(tensors: dict) -> dict:
    """Map every source tensor name to specdec's (midlayer.*, fc.weight, ...), or refuse."""
    from ..errors import SpecdecError

    out = {}
    unknown = []
    for name, t in tensors.items():
        key = name
        if key.startswith(_DROP) or "inv_freq" in key or key.endswith(("cos_cached", "sin_cached")):
            continue
        changed = True
        while changed:
            changed = False
            for p in _PREFIXES:
                if key.startswith(p) and key not in ("d2t", "t2d"):
                    key = key[len(p):]
                    changed = True
        if key.startswith(_DROP):
            continue
        if key.startswith("layers."):
            idx = key.split(".")[1]
            if idx != "0":
                raise SpecdecError(
                    f"the drafter has more than one decoder layer ({name}): specdec's EAGLE-3 drafter has one "
                    f"(midlayer); multi-layer drafters are not supported"
                )
            key = "midlayer." + key[len("layers.0."):]
        if not (key.startswith(_KNOWN) or key in ("d2t", "t2d")):
            unknown.append(name)
            continue
        if key in out:
            raise SpecdecError(f"two tensors map to {key} ({name} and another): "
                               "expected one EAGLE-3 drafter per folder")
        out[key] = t
    if unknown:
        raise SpecdecError(
            f"unknown tensor names {unknown[:4]}{' ...' if len(unknown) > 4 else ''}: expected an EAGLE-3 drafter "
            f"(fc, midlayer/layers.0, norm, lm_head, d2t, t2d)"
        )
    if "fc.weight" not in out or "lm_head.weight" not in out:
        raise SpecdecError(
            f"no fc.weight / lm_head.weight among {sorted(out)[:6]}: not an EAGLE-3 drafter (EAGLE-1/2 drafters "
            f"have no fc over three target states)"
        )
    return out


def detect_source(raw: dict, tensors: dict) -> str:
    if raw.get("speculators_model_type") or "Eagle3Speculator" in (raw.get("architectures") or []):
        return "speculators"
    if isinstance(raw.get("specdec"), dict) and raw["specdec"].get("aux_layer_ids_canonical") is not None:
        return "specdec"
    if (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") is not None \
            and raw.get("eagle_aux_hidden_state_layer_ids") is None:
        return "specforge"  # the tool that writes only eagle_config ids in training
    return "eagle"


def source_ids(raw: dict, source: str) -> tuple[list[int] | None, str]:
    """(aux ids as written in SRC's config, where they were found)."""
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if source == "specdec":
        return list(raw["specdec"]["aux_layer_ids_canonical"]), "specdec.aux_layer_ids_canonical"
    if source == "specforge" and nested is not None:
        return list(nested), "eagle_config.eagle_aux_hidden_state_layer_ids"
    if top is not None:
        return list(top), "eagle_aux_hidden_state_layer_ids"
    if nested is not None:
        return list(nested), "eagle_config.eagle_aux_hidden_state_layer_ids"
    return None, "none in config.json"


def parse_ids(text: str) -> list[int]:
    from ..errors import SpecdecError

    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise SpecdecError(f"--aux-layer-ids expects comma-separated integers like 1,14,26, got {text!r}") from None


def build_drafter(raw: dict, tensors: dict, *, canonical: list[int], target_like):
    """An Eagle3Drafter from the normalized tensors; returns (drafter, has_embeddings, notes)."""
    import torch

    from ..errors import IncompatibleDrafter, SpecdecError
    from ..models.drafter import Eagle3Drafter
    from .formats import parse_config

    notes = []
    fc, head = tensors["fc.weight"], tensors["lm_head.weight"]
    conf = dict(raw)
    conf["specdec"] = {"aux_layer_ids_canonical": canonical}
    if not conf.get("speculators_model_type"):
        conf["architectures"] = ["LlamaForCausalLMEagle3"]
        conf.setdefault("draft_vocab_size", head.shape[0])
        if not conf.get("target_hidden_size"):
            conf["target_hidden_size"] = fc.shape[1] // max(1, len(canonical))
    else:
        conf.setdefault("draft_vocab_size", head.shape[0])
    try:
        cfg = parse_config(conf)
    except KeyError as e:
        raise SpecdecError(f"config.json lacks {e.args[0]!r}: expected a Llama-style drafter config") from None
    if "t2d" in tensors and tensors["t2d"].numel() != cfg.vocab_size:
        raise IncompatibleDrafter(
            f"t2d has {tensors['t2d'].numel()} entries but config vocab_size is {cfg.vocab_size}: "
            "config and tensors disagree"
        )
    if head.shape[0] != cfg.draft_vocab_size:
        raise IncompatibleDrafter(f"lm_head has {head.shape[0]} rows but draft_vocab_size is {cfg.draft_vocab_size}")
    if fc.shape != (cfg.hidden_size, len(canonical) * cfg.target_hidden_size):
        raise IncompatibleDrafter(
            f"fc.weight is {tuple(fc.shape)}, "
            f"expected ({cfg.hidden_size}, {len(canonical)} x {cfg.target_hidden_size}) "
            f"for {len(canonical)} aux layer ids {canonical}"
        )
    # Vocabulary mapping: d2t is what vLLM and SGLang use; t2d only mirrors it.
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    lost = (d2t is not None and t2d is not None and cfg.draft_vocab_size < cfg.vocab_size and not bool(d2t.any())
            and int(t2d.bool().sum()) == cfg.draft_vocab_size and not bool(t2d.bool()[:cfg.draft_vocab_size].all()))
    if lost:
        # An all-zero d2t maps draft id i to target id i; t2d still says which ids were kept.
        d2t = None
        notes.append("d2t was all zeros with a reduced vocab (the mapping lost); rebuilt it from t2d")
    if d2t is None and t2d is not None:
        ids = t2d.bool().nonzero().flatten()
        if ids.numel() != cfg.draft_vocab_size:
            raise IncompatibleDrafter(f"t2d marks {ids.numel()} tokens, "
                                      f"expected draft_vocab_size={cfg.draft_vocab_size}")
        d2t = ids - torch.arange(ids.numel())
        notes.append("d2t rebuilt from t2d (the source saved only t2d)")
    if d2t is None:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise IncompatibleDrafter(
                f"no d2t or t2d tensor and a reduced draft vocab ({cfg.draft_vocab_size} of {cfg.vocab_size}): the "
                f"lm_head rows cannot be mapped to target tokens (acceptance would collapse); find the vocab mapping "
                f"the drafter was trained with"
            )
        d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    d2t = d2t.long()
    if d2t.numel() != cfg.draft_vocab_size:
        raise IncompatibleDrafter(f"d2t has {d2t.numel()} entries, expected draft_vocab_size={cfg.draft_vocab_size}")
    target_ids = torch.arange(d2t.numel()) + d2t
    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
        raise IncompatibleDrafter(
            f"d2t maps to target ids {int(target_ids.min())}..{int(target_ids.max())}, "
            f"outside the vocab 0..{cfg.vocab_size - 1}"
        )
    if t2d is not None:
        t2d = t2d.bool()
        if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[target_ids].all()):
            notes.append("t2d disagreed with d2t; rebuilt it from d2t (vLLM and SGLang read only d2t)")
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[target_ids] = True

    drafter = Eagle3Drafter(cfg)
    state = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    has_embed = "embed_tokens.weight" in state
    if not has_embed and target_like is not None:
        state["embed_tokens.weight"] = target_like.embed_tokens().weight.detach().float().cpu()
        notes.append(f"embed_tokens taken from the target {target_like.name} (the source saved none)")
    state = {k: v.float() for k, v in state.items()}
    try:
        missing, unexpected = drafter.load_state_dict(state, strict=False)
    except RuntimeError as e:
        first = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise IncompatibleDrafter(f"tensors do not match config.json: {first}") from e
    missing = [m for m in missing if not m.startswith(("rotary_emb.", "d2t", "t2d", "embed_tokens."))]
    if missing or unexpected:
        raise IncompatibleDrafter(
            f"not the EAGLE-3 layout specdec runs (flags from config: norm_before_fc={cfg.norm_before_fc}, "
            f"fc_norm={cfg.fc_norm}): missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    drafter.d2t.copy_(d2t)
    drafter.t2d.copy_(t2d)
    return drafter.eval(), has_embed or target_like is not None, notes
