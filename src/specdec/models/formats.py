"""Drafter checkpoints in the two formats serving engines load, and the checks that refuse a
drafter that does not fit its target.

eagle3      config.json = a Llama config with num_hidden_layers=1,
            architectures ["LlamaForCausalLMEagle3"], draft_vocab_size, target_hidden_size,
            top-level eagle_aux_hidden_state_layer_ids (vLLM) and
            eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's convention); tensors
            fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d[, embed_tokens.weight].
speculators architectures ["Eagle3Speculator"], transformer_layer_config, the norm flags,
            speculators_config; tensors under layers.0.* instead of midlayer.*.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..atomic import atomic_path, write_json
from ..conventions import from_canonical, to_canonical
from ..errors import IncompatibleDrafter, SpecdecError
from .drafter import DrafterConfig, Eagle3Drafter

FORMATS = ("eagle3", "speculators")
WEIGHTS = "model.safetensors"
_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _llama_part(cfg: DrafterConfig, dtype_name: str = "bfloat16") -> dict:
    lc = cfg.llama_config().to_dict()
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "hidden_act",
            "num_hidden_layers", "rope_theta", "rope_scaling", "rope_parameters")
    out = {k: lc[k] for k in keep if k in lc}
    out.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
               rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
               attention_bias=False, mlp_bias=False, torch_dtype=dtype_name)
    return out


def sglang_config_ids(ids: list[int], model_type: str | None) -> list[int]:
    """eagle_config ids that make SGLang feed canonical `ids` for this target. Where no writing
    can (specdec.conventions says why), the canonical ids are written and `export`'s engine check
    says SGLang will not feed them."""
    try:
        return from_canonical(ids, "sglang", model_type)
    except SpecdecError:
        return list(ids)


def config_dict(cfg: DrafterConfig, fmt: str, target_name: str | None = None, k: int = 5,
                dtype_name: str = "bfloat16") -> dict:
    """`dtype_name` is the dtype of the saved tensors: loaders (HF `from_pretrained`, vLLM) cast
    to it, so it must match what `save_drafter` writes. Every key an engine defaults is written:
    vLLM guesses ids absent from the top level, and its speculators reader defaults
    norm_before_residual to True (specdec.engine_rules)."""
    ids = list(cfg.aux_layer_ids)
    flags = {f: getattr(cfg, f) for f in _FLAGS}
    ours = {"aux_layer_ids_canonical": ids, "target": target_name, "target_model_type": cfg.target_model_type,
            "target_num_layers": cfg.target_num_layers, "provenance": cfg.provenance}
    if fmt == "eagle3":
        return {
            **_llama_part(cfg, dtype_name),
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": from_canonical(ids, "vllm"),
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": sglang_config_ids(ids, cfg.target_model_type),
                "use_aux_hidden_state": True,
                "use_input_layernorm_in_first_layer": True,
                "use_last_layernorm": True,
                "use_mtp_layernorm": False,
            },
            **flags,
            "specdec": ours,
        }
    if fmt == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.9.0",
            "transformer_layer_config": _llama_part(cfg, dtype_name),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": from_canonical(ids, "speculators"),
            **flags,
            "embed_requires_grad": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
                "verifier": {"name_or_path": target_name, "architectures": []},
            },
            "torch_dtype": dtype_name,
            "specdec": ours,
        }
    raise SpecdecError(f"unknown drafter format {fmt!r}; expected one of {', '.join(FORMATS)}")


def engine_layout(drafter: Eagle3Drafter) -> Eagle3Drafter:
    """The same drafter laid out as vLLM and SGLang read it (specdec.engine_rules): aux ids in
    ascending order, with fc's column blocks (and the norms before fc) reordered to match, since
    both engines concatenate the captured layers in layer order; at full vocab, lm_head rows in
    target-id order, since vLLM refuses a d2t there. Both are exact permutations. Returns
    `drafter` itself when nothing moves."""
    import copy

    cfg = drafter.cfg
    ids = list(cfg.aux_layer_ids)
    if len(set(ids)) != len(ids):
        raise IncompatibleDrafter(
            f"aux layer ids {ids} repeat a layer: vLLM and SGLang capture each layer once, so the fc would "
            f"read fewer states than it was trained on; retrain with distinct ids"
        )
    order = sorted(range(len(ids)), key=ids.__getitem__)
    full_vocab = cfg.draft_vocab_size == cfg.vocab_size
    if order == list(range(len(ids))) and not (full_vocab and bool(drafter.d2t.any())):
        return drafter
    out = copy.deepcopy(drafter)
    out.cfg.aux_layer_ids = [ids[i] for i in order]
    tH = cfg.target_hidden_size
    cols = torch.cat([torch.arange(i * tH, (i + 1) * tH) for i in order])
    with torch.no_grad():
        out.fc.weight.copy_(drafter.fc.weight[:, cols])
        if out.input_norm is not None:
            out.input_norm.weight.copy_(drafter.input_norm.weight[cols])
        if out.fc_norm is not None:
            for dst, src in zip(out.fc_norm, [drafter.fc_norm[i] for i in order]):
                dst.weight.copy_(src.weight)
        if full_vocab and bool(drafter.d2t.any()):
            rows = torch.empty_like(drafter.d2t)
            rows[drafter.draft_to_target.cpu()] = torch.arange(cfg.draft_vocab_size)
            out.lm_head.weight.copy_(drafter.lm_head.weight[rows.to(drafter.lm_head.weight.device)])
            out.set_vocab_mapping(torch.arange(cfg.vocab_size))
    return out


def save_drafter(drafter: Eagle3Drafter, out_dir: str | Path, fmt: str = "eagle3", *,
                 target_name: str | None = None, k: int = 5, dtype=torch.bfloat16,
                 include_embeddings: bool = True) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drafter = engine_layout(drafter)
    cfg = config_dict(drafter.cfg, fmt, target_name, k, _DTYPE_NAMES.get(dtype, "float32"))
    tensors = {}
    for name, t in drafter.state_dict().items():
        if name.startswith("rotary_emb."):
            continue
        if name == "embed_tokens.weight" and not include_embeddings:
            continue
        if name in ("d2t", "t2d") and drafter.cfg.draft_vocab_size == drafter.cfg.vocab_size:
            continue  # identity at full vocab (engine_layout); vLLM refuses a d2t there
        if fmt == "speculators":
            name = name.replace("midlayer.", "layers.0.")
        t = t.detach().cpu().contiguous()
        tensors[name] = t.to(dtype) if t.is_floating_point() else t
    with atomic_path(out_dir / WEIGHTS) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json(out_dir / "config.json", cfg)  # last: a folder with config.json is complete
    return out_dir


def detect_format(cfg: dict) -> str:
    arch = (cfg.get("architectures") or [""])[0]
    if cfg.get("speculators_model_type") == "eagle3" or arch == "Eagle3Speculator":
        return "speculators"
    if "Eagle3" in arch or "eagle_config" in cfg or "draft_vocab_size" in cfg:
        return "eagle3"
    raise SpecdecError(
        f"config.json has architectures {cfg.get('architectures')}: expected an EAGLE-3 drafter "
        f"(LlamaForCausalLMEagle3 or Eagle3Speculator); import other forms with `specdec convert`"
    )


def parse_config(cfg: dict, num_target_layers: int | None = None,
                 target_model_type: str | None = None) -> DrafterConfig:
    """The drafter a config describes. Ids come from specdec's own record, else the top-level
    key (vLLM's), else eagle_config's read by SGLang's rule for the target's architecture; flags
    an engine defaults are defaulted as vLLM does (norm_before_residual True in speculators)."""
    fmt = detect_format(cfg)
    layer = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    record = cfg.get("specdec") if isinstance(cfg.get("specdec"), dict) else {}
    trained_for = record.get("target_model_type")  # what it was trained for, over the target at hand
    target_model_type = trained_for or target_model_type
    ours = record.get("aux_layer_ids_canonical")
    if ours is not None:
        ids = list(ours)
    elif fmt == "speculators" or cfg.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids = to_canonical(list(cfg.get("eagle_aux_hidden_state_layer_ids") or []), "vllm")
    elif (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        ids = to_canonical(list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]), "sglang", target_model_type)
    else:
        ids = []
    if not ids:
        if num_target_layers is None:
            raise SpecdecError("drafter config names no aux layer ids and no target was given to default them")
        from ..conventions import default_aux_layer_ids

        ids = default_aux_layer_ids(num_target_layers)
    heads = layer["num_attention_heads"]
    rope = layer.get("rope_parameters") or {}
    scaling = layer.get("rope_scaling")
    if not scaling and rope.get("rope_type", rope.get("type", "default")) != "default":
        # transformers 5 writes scaling (llama3, yarn, ...) only inside rope_parameters
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling and "rope_type" not in scaling and "type" in scaling:
        scaling = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": scaling["type"]}
    return DrafterConfig(
        hidden_size=layer["hidden_size"],
        intermediate_size=layer["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads,
        head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        vocab_size=layer["vocab_size"],
        draft_vocab_size=cfg.get("draft_vocab_size") or layer["vocab_size"],
        target_hidden_size=cfg.get("target_hidden_size") or layer["hidden_size"],
        aux_layer_ids=ids,
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=float(layer.get("rope_theta") or rope.get("rope_theta", 10000.0)),
        rope_scaling=scaling or None,
        max_position_embeddings=layer.get("max_position_embeddings", 4096),
        hidden_act=layer.get("hidden_act", "silu"),
        **{f: bool(cfg.get(f, fmt == "speculators" and f == "norm_before_residual")) for f in _FLAGS},
        target_model_type=target_model_type,
        target_num_layers=record.get("target_num_layers") or num_target_layers,
        provenance=dict(record.get("provenance") or {}),
    )


def pickle_refusal(path: Path) -> SpecdecError:
    """The one answer to a pickle offered as weights: it is never opened (unpickling runs code)."""
    return SpecdecError(f"{path} is a pickle file that specdec never loads (unpickling runs code); convert it to "
                        f"safetensors with a tool you trust, then retry")


def refuse_pickle_only(folder: Path) -> None:
    """A folder whose weights are only pickles is refused before anything reads it."""
    if any(folder.glob("*.safetensors")) or any(folder.glob("*.gguf")):
        return
    pickles = sorted(f for f in folder.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise pickle_refusal(pickles[0])


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        refuse_pickle_only(folder)
        raise SpecdecError(f"no .safetensors file in {folder}: expected {WEIGHTS} next to config.json")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise SpecdecError(f"could not read {f}: {e}; the file looks truncated or corrupt, export it again") from e
    return tensors


def load_drafter(path: str | Path, target=None, *, device=None, dtype=torch.float32) -> Eagle3Drafter:
    """Load a drafter in either format; with `target`, refuse one that does not fit it."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise SpecdecError(f"no drafter at {folder}: expected a folder with config.json and *.safetensors")
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{folder / 'config.json'} is not valid JSON ({e}); export the drafter again") from e
    if not isinstance(raw, dict):
        raise SpecdecError(f"{folder / 'config.json'} holds a JSON {type(raw).__name__}: expected an object")
    try:
        cfg = parse_config(raw, target.num_layers if target is not None else None,
                           getattr(getattr(target, "config", None), "model_type", None))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        what = f"lacks {e.args[0]!r}" if isinstance(e, KeyError) else f"has a field of the wrong type ({e})"
        raise SpecdecError(f"{folder / 'config.json'} {what}: expected an EAGLE-3 drafter config (hidden_size, "
                           f"intermediate_size, num_attention_heads, vocab_size, ...); export the drafter "
                           f"again") from None
    tensors = {k.replace("layers.0.", "midlayer."): v for k, v in read_tensors(folder).items()}
    if "d2t" not in tensors and cfg.draft_vocab_size == cfg.vocab_size:
        # A full-vocab drafter needs no mapping; speculators then saves no d2t/t2d at all.
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "d2t" not in tensors:
        raise IncompatibleDrafter(
            f"{folder} has no d2t tensor: its lm_head rows cannot be mapped to target tokens "
            f"(acceptance would collapse); re-export it with its vocab mapping"
        )
    if target is not None:
        check_fits(cfg, tensors, target, folder)
    drafter = Eagle3Drafter(cfg)
    if "embed_tokens.weight" not in tensors:
        if target is None:
            raise SpecdecError(f"{folder} has no embed_tokens.weight; load it together with its target")
        tensors["embed_tokens.weight"] = target.embed_tokens().weight.detach().float().cpu()
    if "t2d" not in tensors:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + tensors["d2t"].long()] = True
        tensors["t2d"] = t2d
    tensors = {k: v for k, v in tensors.items() if not k.startswith(("verifier_", "rotary_emb."))}
    try:
        missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # a tensor shape that disagrees with config.json
        first = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise IncompatibleDrafter(f"{folder}: tensors do not match its config.json: {first}") from e
    missing = [m for m in missing if not m.startswith("rotary_emb.")]
    if missing or unexpected:
        raise IncompatibleDrafter(
            f"{folder} does not match the EAGLE-3 layout: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    drafter.d2t.copy_(tensors["d2t"].long())
    device = device or (target.device if target is not None else "cpu")
    return drafter.to(device=device, dtype=dtype).eval()


def check_fits(cfg: DrafterConfig, tensors: dict, target, folder) -> None:
    """One-line refusals for a drafter that was trained for another target."""
    if cfg.target_hidden_size != target.hidden_size:
        raise IncompatibleDrafter(
            f"drafter {folder} expects target hidden size {cfg.target_hidden_size}, "
            f"but {target.name} has {target.hidden_size}: it was trained for another target"
        )
    if cfg.vocab_size != target.vocab_size:
        raise IncompatibleDrafter(
            f"drafter {folder} has vocab size {cfg.vocab_size}, but {target.name} has "
            f"{target.vocab_size}: it was trained for another target (or tokenizer)"
        )
    kind = getattr(getattr(target, "config", None), "model_type", None)  # None: a stand-in, not a target
    if kind and ((cfg.target_model_type and cfg.target_model_type != kind) or (
            cfg.target_num_layers and cfg.target_num_layers != target.num_layers)):
        # Same shapes, so it runs, but on another model's hidden states: say so, once, before it does.
        import sys

        print(f"specdec: warning: drafter {folder} was trained for a {cfg.target_model_type} target with "
              f"{cfg.target_num_layers} layers; {target.name} is a {kind} with {target.num_layers}: expect low "
              f"acceptance (`specdec doctor` checks this)", file=sys.stderr)
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i <= target.num_layers]
    if bad:
        raise IncompatibleDrafter(
            f"drafter {folder} reads layers {cfg.aux_layer_ids} but {target.name} has "
            f"{target.num_layers} layers: it was trained for another target"
        )
    d2t = tensors["d2t"].long()
    if d2t.numel() != cfg.draft_vocab_size:
        raise IncompatibleDrafter(f"drafter {folder}: d2t has {d2t.numel()} entries, "
                                  f"expected draft_vocab_size={cfg.draft_vocab_size}")
    ids = torch.arange(d2t.numel()) + d2t
    if ids.min() < 0 or ids.max() >= target.vocab_size:
        raise IncompatibleDrafter(
            f"drafter {folder}: d2t maps to target ids {int(ids.min())}..{int(ids.max())}, "
            f"outside the target vocab 0..{target.vocab_size - 1}"
        )
    fc = tensors.get("fc.weight")
    if fc is not None and fc.shape[1] != len(cfg.aux_layer_ids) * target.hidden_size:
        raise IncompatibleDrafter(
            f"drafter {folder}: fc reads {fc.shape[1]} features, expected "
            f"{len(cfg.aux_layer_ids)} x {target.hidden_size} from {target.name}"
        )
