"""`specdec export`: write a drafter in the format vLLM / SGLang / speculators load, prove the
written folder reproduces the drafter, and print the exact serve commands.

The helpers here (`write_and_validate`, `describe`, `print_summary`) are shared with `specdec
convert`; the stand-in targets the checks read are in `specdec.models.target_shape`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

DESCRIPTION = """\
Export a trained EAGLE-3 drafter for serving. The drafter is loaded (and checked against the
target when --target is given: hidden size, vocab, layer count, d2t range), written atomically,
then the written folder is loaded again and must give the same logits as the drafter on a random
input. Then each engine's reading of the folder is checked with the loading rules of its released
code (specdec/engine_rules.py: vLLM 0.34.0, SGLang 0.5.23): which tensors it loads, which target
hidden states it feeds the drafter and in what order, which norm switches it applies; the drafter
as the engine builds it is fed those states and its logits compared with the drafter fed as in
training. Per engine it prints "loads; feeds hidden_states[...] = trained on [...]" or the
reason it will not run as trained. The exact serve commands and the aux layer ids in each tool's
convention follow: an off-by-one there is the most common cause of collapsed acceptance.

The written layout is the one both engines read as trained: aux ids ascending (fc's column blocks
reordered to match), every key an engine would otherwise guess written out, no d2t/t2d at full
vocab (lm_head rows in target-id order), eagle_config ids written for SGLang's rule for the
target's architecture (--target or --target-type, else what the drafter recorded in training).

exit status: 0 written (and, with --for, runs as trained there); 1 written, but an engine named
by --for would not run it as trained; 2 an error, nothing usable written.

formats:
  eagle3       LlamaForCausalLMEagle3 config + midlayer.* tensors: vLLM and SGLang
  speculators  Eagle3Speculator config (vllm-project/speculators): vLLM, `vllm serve OUT`

examples:
  specdec export --drafter runs/quickstart/train/drafter --target smollm2-135m-instruct \\
      --format eagle3 runs/quickstart/export
  specdec export --drafter DIR --target smollm2-135m-instruct --format speculators --dtype bf16 OUT
  specdec export --drafter DIR --format eagle3 --no-embeddings --json OUT   # serving shares the target's
  specdec export --drafter DIR --target-type deepseek_v3 --for sglang OUT    # fail unless SGLang runs it right
  specdec export --drafter DIR --format speculators --verifier meta-llama/Llama-3.1-8B-Instruct OUT
      # a hub id as verifier also prints the short `vllm serve OUT` form
"""

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a drafter for vLLM / SGLang / speculators and validate it",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--drafter", required=True, metavar="DIR", help="drafter folder (eagle3 or speculators format)")
    p.add_argument("--format", choices=["eagle3", "speculators"], default="eagle3", help="default: eagle3")
    add_output_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (path, format, serve commands, layer ids, per-engine readings)")
    p.set_defaults(func=run)


def add_output_args(p) -> None:
    """Flags shared by export and convert."""
    p.add_argument("--target", metavar="MODEL",
                   help="the target (registry name, HF folder, .gguf): checks the drafter fits it and names it in "
                        "the serve commands; only its config and embedding matrix are read when it is an HF folder")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="dtype of the written tensors (default: bf16)")
    p.add_argument("--no-embeddings", action="store_true",
                   help="leave embed_tokens.weight out (vLLM and SGLang then share the target's embedding)")
    p.add_argument("--k", "--num-speculative-tokens", dest="k", type=int, default=5, metavar="K",
                   help="draft tokens per step in the serve commands and speculators_config (default: 5)")
    p.add_argument("--verifier", metavar="NAME",
                   help="verifier name_or_path written into a speculators config (default: the target as resolved); "
                        "vLLM's short `vllm serve OUT` form works only when it is a hub repository id")
    p.add_argument("--target-type", metavar="MODEL_TYPE",
                   help="the target's model_type (llama, qwen2, qwen3, mistral, deepseek_v3, ...) when --target is "
                        "not at hand: decides how SGLang reads the aux ids (default: what the drafter recorded)")
    p.add_argument("--for", dest="for_engine", choices=["vllm", "sglang", "both"],
                   help="exit 1 unless this engine (or both) would run the export exactly as trained")
    p.add_argument("--force", action="store_true", help="replace an OUT folder that holds other weight files")


# ---------------------------------------------------------------------------------------------
# Write, reload, compare


def prepare_out(out: Path, sources: list[Path], force: bool) -> None:
    from ..errors import SpecdecError

    if out.exists() and not out.is_dir():
        raise SpecdecError(f"{out} is a file: expected a folder to write the drafter into")
    for src in sources:
        if src.exists() and out.exists() and out.resolve() == src.resolve():
            raise SpecdecError(f"OUT {out} is the input folder: write the export to a new folder")
    if not out.is_dir():
        return
    stale = sorted(p.name for p in out.iterdir()
                   if (p.suffix in (".safetensors", ".bin", ".pt", ".pth") or p.name.endswith(".index.json"))
                   and p.name != "model.safetensors")
    if stale and not force:
        raise SpecdecError(
            f"{out} already holds {', '.join(stale[:3])}: loaders would mix them with the export; "
            f"choose an empty folder or pass --force to remove them"
        )
    for name in stale:
        (out / name).unlink()


def write_and_validate(drafter, out: Path, fmt: str, *, target_like, target_name, verifier, k: int,
                       dtype_flag: str, include_embeddings: bool) -> dict:
    """Save `drafter` to `out` in `fmt`, load the folder back and require the same logits, then
    read the folder as each engine does (specdec.engine_rules) and run it as each would."""
    import copy

    import torch

    from ..engine_rules import TargetFacts, check_folder, logit_gap, random_states, target_space_logits
    from ..errors import SpecdecError
    from ..models.formats import load_drafter, save_drafter
    from ..models.target_shape import SelfShape

    dtype = getattr(torch, DTYPES[dtype_flag])
    drafter = drafter.to("cpu").float().eval()
    save_drafter(drafter, out, fmt, target_name=verifier, k=k, dtype=dtype, include_embeddings=include_embeddings)
    # The reference is the drafter rounded to the written dtype: the reload must match it exactly.
    trained = copy.deepcopy(drafter)
    with torch.no_grad():
        for param in trained.parameters():  # parameters only: rotary buffers stay fp32 on load
            param.copy_(param.to(dtype).float())
    reference = copy.deepcopy(trained)
    check_target = target_like if target_like is not None else SelfShape(drafter)
    embed_note = None
    shared = check_target.embed_tokens().weight.detach().float().cpu()
    if not include_embeddings:
        # Servers (and the reload) then use the target's embedding, in full precision.
        own = drafter.embed_tokens.weight.detach().float()
        if shared.shape != own.shape or not torch.allclose(shared, own, rtol=1e-2, atol=1e-3):
            embed_note = ("the drafter's embedding differs from the target's: without embeddings it will run "
                          "with the target's, which is not what it was trained with")
        with torch.no_grad():
            reference.embed_tokens.weight.copy_(shared)
    try:
        reloaded = load_drafter(out, check_target, device="cpu", dtype=torch.float32)
    except SpecdecError as e:
        raise SpecdecError(f"the written folder does not load back: {e}") from e
    problems = []
    if sorted(reloaded.cfg.aux_layer_ids) != sorted(drafter.cfg.aux_layer_ids):
        problems.append(f"aux layer ids {drafter.cfg.aux_layer_ids} came back as {reloaded.cfg.aux_layer_ids}")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "draft_vocab_size",
                 "target_hidden_size", "vocab_size", "hidden_size", "head_dim", "num_key_value_heads"):
        if getattr(reloaded.cfg, flag) != getattr(drafter.cfg, flag):
            problems.append(f"{flag} {getattr(drafter.cfg, flag)} came back as {getattr(reloaded.cfg, flag)}")
    if not torch.equal(reloaded.draft_to_target.cpu().sort().values, drafter.draft_to_target.cpu().sort().values):
        problems.append("the draft vocabulary differs")
    # Compared in target-token space: the written layout may reorder fc blocks and lm_head rows.
    states = random_states(max(drafter.cfg.aux_layer_ids), drafter.cfg.target_hidden_size, tokens=12)
    vocab = drafter.cfg.vocab_size
    want = target_space_logits(reference, reference.d2t, states, list(drafter.cfg.aux_layer_ids), vocab)
    got = target_space_logits(reloaded, reloaded.d2t.cpu(), states, list(reloaded.cfg.aux_layer_ids), vocab)
    diff = logit_gap(want, got)
    scale = float(want[~torch.isinf(want)].abs().max()) or 1.0
    if not diff <= 1e-5 * max(1.0, scale):
        problems.append(f"logits differ by {diff:.3g} (max |logit| {scale:.3g})")
    if problems:
        raise SpecdecError(f"export validation failed for {out}: {'; '.join(problems)}")
    facts = TargetFacts.of(target_like) if target_like is not None else TargetFacts.recorded(drafter.cfg)
    readings = check_folder(out, trained, facts, shared)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {"max_abs_logit_diff": diff, "bytes": size, "checked_against": getattr(check_target, "name", None),
            "embedding_note": embed_note, "readings": readings, "trained_ids": list(drafter.cfg.aux_layer_ids)}


# ---------------------------------------------------------------------------------------------
# What to tell the user


def describe(out: Path, fmt: str, cfg, *, serve_target: str | None, k: int, dtype_flag: str,
             verifier: str | None = None, validation: dict | None = None) -> dict:
    from ..conventions import from_canonical
    from ..engine_rules import vllm_short_form_ok

    ids = sorted(cfg.aux_layer_ids)
    written = json.loads((out / "config.json").read_text())
    layer_ids = {
        "canonical": ids,
        "eagle": from_canonical(ids, "eagle"),
        "vllm": from_canonical(ids, "vllm"),
        "speculators": from_canonical(ids, "speculators"),
        "specforge": from_canonical(ids, "specforge"),
        "modelopt": from_canonical(ids, "modelopt"),
        "sglang": (written.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
    }
    warnings = []
    target = shlex.quote(serve_target) if serve_target else "TARGET"
    out_abs = str(out.resolve())
    spec = json.dumps({"method": "eagle3", "model": out_abs, "num_speculative_tokens": k}, separators=(",", ":"))
    vllm = f"vllm serve {target} --speculative-config {shlex.quote(spec)}"
    serve = {"vllm": vllm}
    if fmt == "speculators":
        # The short form reads the target from speculators_config.verifier, which must be a hub id.
        serve["vllm_short"] = f"vllm serve {shlex.quote(out_abs)}" if vllm_short_form_ok(verifier) else None
        serve["sglang"] = None
    else:
        serve["sglang"] = (
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {shlex.quote(out_abs)} --speculative-num-steps {k} "
            "--speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {k + 1}"
        )
    if serve_target is None:
        warnings.append("no --target given: "
                        "replace TARGET in the serve commands with the target the drafter was trained for")
    engines = {}
    if validation is not None:
        engines = {e: r.to_json(validation["trained_ids"]) for e, r in validation["readings"].items()}
    return {
        "path": out_abs, "format": fmt, "dtype": DTYPES[dtype_flag], "target": serve_target, "k": k,
        "target_model_type": cfg.target_model_type, "serve": serve, "aux_layer_ids": layer_ids,
        "norm_before_residual": cfg.norm_before_residual, "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output, "draft_vocab_size": cfg.draft_vocab_size,
        "engines": engines, "warnings": warnings,
    }


def print_summary(info: dict, validation: dict, verb: str = "exported") -> None:
    from rich.console import Console
    from rich.markup import escape

    con = Console(highlight=False, soft_wrap=True)
    ids = info["aux_layer_ids"]
    con.print(f"[bold]{verb}[/] {info['path']} ({info['format']}, {info['dtype']}, "
              f"{validation['bytes'] / 1e6:.1f} MB); reloaded and checked against {validation['checked_against']}: "
              f"logits equal (max |diff| {validation['max_abs_logit_diff']:.1g})")
    con.print("how each engine reads it (its released loading code, specdec/engine_rules.py):")
    for e in info["engines"].values():
        name = f"{'vLLM' if e['engine'] == 'vllm' else 'SGLang'} {e['version']}:"
        colour = "green" if e["ok"] else "red"
        con.print(f"  [{colour}]{name:<15}[/] {escape(e['verdict'])}")
    con.print("aux layer ids, as each tool must be told for this drafter:")
    con.print(f"  EAGLE reference / vLLM / speculators (HF hidden_states index): {ids['canonical']}")
    con.print(f"  SpecForge / ModelOpt (index of the decoder layer whose output): {ids['specforge']}")
    if ids["sglang"] is not None:
        con.print(f"  SGLang eagle_config (read by its rule for {info['target_model_type'] or 'the target'}):"
                  f" {ids['sglang']}")
    con.print("serve with vLLM:")
    con.print(f"  {info['serve']['vllm']}")
    if info["serve"].get("vllm_short"):
        con.print(f"  {info['serve']['vllm_short']}   (target read from speculators_config.verifier)")
    if info["serve"].get("sglang"):
        con.print("serve with SGLang:")
        con.print(f"  {info['serve']['sglang']}")
    else:
        con.print("SGLang: export with --format eagle3")
    for w in info["warnings"]:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"[yellow]warning:[/] {escape(w)}")


def engine_exit_code(info: dict, for_engine: str | None) -> int:
    """1 when an engine the user asked for would not run the export as trained."""
    wanted = ("vllm", "sglang") if for_engine == "both" else (for_engine,) if for_engine else ()
    return 1 if any(not info["engines"][e]["ok"] for e in wanted) else 0


def adopt_target(drafter, target_like, target_type: str | None) -> None:
    """Record the serving target's architecture and depth in the drafter, so the written ids
    follow SGLang's rule for it."""
    if target_like is not None:
        drafter.cfg.target_model_type = getattr(target_like.config, "model_type", None)
        drafter.cfg.target_num_layers = target_like.num_layers
    if target_type:
        drafter.cfg.target_model_type = target_type


def finish(args, info: dict, validation: dict, verb: str, before=()) -> int:
    """Print (or --json) what was written and how each engine reads it; the exit status."""
    if args.json:
        print(json.dumps(info))
        for w in info["warnings"]:
            print(f"specdec {verb}: warning: {w}", file=sys.stderr)
    else:
        for line in before:
            print(line)
        print_summary(info, validation, verb="converted" if verb == "convert" else "exported")
    return engine_exit_code(info, args.for_engine)


def run(args) -> int:
    from ..errors import SpecdecError
    from ..models.formats import load_drafter
    from ..models.target_shape import target_for_checks

    if args.k < 1:
        raise SpecdecError(f"--k must be at least 1, got {args.k}")
    src = Path(args.drafter)
    out = Path(args.out)
    prepare_out(out, [src], args.force)
    target_like, serve_target = target_for_checks(args.target) if args.target else (None, None)
    drafter = load_drafter(src, target_like, device="cpu")
    adopt_target(drafter, target_like, args.target_type)
    verifier = args.verifier or serve_target
    validation = write_and_validate(drafter, out, args.format, target_like=target_like, target_name=serve_target,
                                    verifier=verifier, k=args.k, dtype_flag=args.dtype,
                                    include_embeddings=not args.no_embeddings)
    info = describe(out, args.format, drafter.cfg, serve_target=serve_target, k=args.k, dtype_flag=args.dtype,
                    verifier=verifier, validation=validation)
    info["validation"] = {k: v for k, v in validation.items() if k != "readings"}
    info["source"] = str(src)
    if validation["embedding_note"]:
        info["warnings"].append(validation["embedding_note"])
    return finish(args, info, validation, "export")
