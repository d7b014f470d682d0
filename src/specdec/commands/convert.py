"""`specdec convert`: import an EAGLE-3 drafter trained elsewhere (EAGLE reference, SpecForge,
speculators) into specdec's format, with its aux layer ids translated to the canonical convention.

What each source writes (all read from safetensors only; pickles are refused, never opened):

  eagle        SafeAILab/EAGLE: config = Llama config + draft_vocab_size, usually no aux ids (the
               reference taps the inputs of layers 2, L//2, L-3: canonical defaults); tensors
               fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d[, embed_tokens.weight].
  specforge    sgl-project/SpecForge: the same tensor names saved from LlamaForCausalLMEagle3
               (embeddings dropped; wrappers may add draft_model./model./module. prefixes), and
               ids only in eagle_config.eagle_aux_hidden_state_layer_ids, which SGLang reads by
               the target's architecture (default [1, L//2-1, L-4] = canonical [2, L//2, L-3]).
  speculators  vllm-project/speculators: Eagle3Speculator config, transformer_layer_config,
               tensors under layers.0.*, top-level ids in the canonical convention.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .export import add_output_args

DESCRIPTION = """\
Convert an EAGLE-3 drafter from the EAGLE reference, SpecForge or speculators into specdec's
eagle3 (or speculators) format: tensor names are mapped (layers.0.* -> midlayer.*, wrapper
prefixes such as model./draft_model./module. removed), the aux layer ids are translated from the
source's convention to the canonical one (HF hidden_states index), d2t/t2d are checked, and the
result is written, reloaded and compared like `specdec export`. Only safetensors are read:
convert pytorch_model.bin or other pickles with a tool you trust first.

id conventions (--layer-convention): eagle, vllm, speculators (id k = input of layer k);
specforge, modelopt (id k = output of layer k); sglang (eagle_config ids + 1 for llama, mistral,
qwen2, qwen3 targets; for deepseek_v2/v3, Kimi and glm4_moe_lite only when the first id is 1).
Ids a config holds only in eagle_config are read as SGLang reads them, by the target's
architecture (--target, or --target-type when the target is not at hand); the rule used is
printed. vLLM reads only the top-level key and guesses (2, L//2, L-3) without it: the export
always writes it.

examples:
  specdec convert ./specforge-out/epoch_9 ./drafter --from specforge --target smollm2-135m-instruct
  specdec convert ./EAGLE3-LLaMA3.1-Instruct-8B ./drafter --from eagle --target ./Llama-3.1-8B-Instruct
      # (that release ships pytorch_model.bin: convert it to safetensors with a tool you trust first)
  specdec convert ./speculator.eagle3 ./drafter --format eagle3      # speculators -> vLLM/SGLang eagle3
  specdec convert SRC OUT --layer-convention specforge --aux-layer-ids 1,14,26
  specdec convert ./kimi-k2.5-eagle3 ./drafter --target-type deepseek_v3 --for both   # eagle_config-only ids
"""

SOURCES = ("auto", "eagle", "specforge", "speculators")


def register(subparsers) -> None:
    p = subparsers.add_parser("convert", help="import an EAGLE / SpecForge / speculators drafter",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="drafter folder (config.json + *.safetensors) or its .safetensors file")
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--from", dest="source", choices=SOURCES, default="auto",
                   help="which tool wrote SRC (default: auto-detect from config and tensor names)")
    p.add_argument("--layer-convention", metavar="CONV",
                   help="convention of the aux ids in SRC's config (default: the source tool's own)")
    p.add_argument("--aux-layer-ids", metavar="IDS",
                   help="comma-separated aux ids in --layer-convention, for configs that name none or wrong ones")
    p.add_argument("--format", choices=["eagle3", "speculators"], default="eagle3",
                   help="output format (default: eagle3)")
    add_output_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (path, format, serve commands, layer ids)")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------------------------
# Reading the source


def run(args) -> int:
    from ..conventions import CONVENTIONS, resolve_aux_layer_ids, to_canonical
    from ..errors import SpecdecError
    from ..models.foreign import (DEFAULT_CONVENTION, build_drafter, detect_source, normalize_names, parse_ids,
                                  read_source, source_ids)
    from ..models.target_shape import target_for_checks
    from .export import adopt_target, describe, finish, prepare_out, write_and_validate

    if args.k < 1:
        raise SpecdecError(f"--k must be at least 1, got {args.k}")
    if args.layer_convention and args.layer_convention.lower() not in CONVENTIONS:
        raise SpecdecError(f"unknown --layer-convention {args.layer_convention!r}; "
                           f"expected one of {', '.join(CONVENTIONS)}")
    src, out = Path(args.src), Path(args.out)
    folder, raw, tensors = read_source(src)
    prepare_out(out, [src, folder], args.force)
    tensors = normalize_names(tensors)
    source = detect_source(raw, tensors) if args.source == "auto" else args.source
    target_like, serve_target = target_for_checks(args.target) if args.target else (None, None)
    num_layers = target_like.num_layers if target_like is not None else None
    model_type = args.target_type or (getattr(target_like.config, "model_type", None) if target_like else None)
    if args.aux_layer_ids:
        ids, where = parse_ids(args.aux_layer_ids), "--aux-layer-ids"
    else:
        ids, where = source_ids(raw, source)
    convention = (args.layer_convention or DEFAULT_CONVENTION[source]).lower()
    if args.layer_convention is None and where.startswith("eagle_config"):
        # Ids found only in eagle_config were written for SGLang, the one engine that reads them:
        # read them by its rule for the target's architecture (specdec.conventions).
        convention = "sglang"
    notes = []
    if ids is None:
        if num_layers is None:
            raise SpecdecError(
                f"{folder / 'config.json'} names no aux layer ids: pass --target (the defaults [2, L//2, L-3] of an "
                f"L-layer target are used) or --aux-layer-ids with --layer-convention"
            )
        canonical = resolve_aux_layer_ids(num_layers)
        how = f"none in config.json; defaults for {num_layers} layers"
    else:
        canonical = (to_canonical(ids, convention, model_type) if num_layers is None
                     else resolve_aux_layer_ids(num_layers, ids, convention, model_type=model_type))
        rule = f" by SGLang's rule for {model_type or 'any architecture'}" if convention == "sglang" else ""
        how = f"{where} = {ids} read as {convention}{rule}"
    if raw.get("eagle_aux_hidden_state_layer_ids") is None and source != "specdec":
        L = num_layers
        guess = [2, L // 2, L - 3] if num_layers else None
        verdict = ("" if guess is None else f" = {guess} for this {L}-layer target, "
                   + ("by luck the trained ids" if guess == canonical else f"not the trained {canonical}"))
        notes.append(f"the source config has no top-level eagle_aux_hidden_state_layer_ids: served as it was, vLLM "
                     f"would guess (2, L//2, L-3){verdict}; the export writes them")
    drafter, has_embed, built_notes = build_drafter(raw, tensors, canonical=canonical, target_like=target_like)
    notes += built_notes
    adopt_target(drafter, target_like, model_type)
    if not has_embed:
        notes.append("no embed_tokens in the source and no --target: "
                     "written without embeddings (servers share the target's)")
    verifier = args.verifier or serve_target
    validation = write_and_validate(drafter, out, args.format, target_like=target_like, target_name=serve_target,
                                    verifier=verifier, k=args.k, dtype_flag=args.dtype,
                                    include_embeddings=has_embed and not args.no_embeddings)
    info = describe(out, args.format, drafter.cfg, serve_target=serve_target, k=args.k, dtype_flag=args.dtype,
                    verifier=verifier, validation=validation)
    info.update(source=str(src), source_format=source, source_layer_convention=convention,
                source_aux_layer_ids=ids, aux_layer_ids_how=how, notes=notes,
                validation={k: v for k, v in validation.items() if k != "readings"})
    if validation["embedding_note"]:
        info["warnings"].append(validation["embedding_note"])
    before = [f"source: {src} ({source}); aux layer ids: {how} -> canonical {canonical}"]
    return finish(args, info, validation, "convert", before + [f"note: {n}" for n in notes])
