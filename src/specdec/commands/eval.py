"""`specdec eval`: acceptance and speed of a drafter, measured by running the engine."""

from __future__ import annotations

import argparse
import json
import sys

from ._engine_args import add_engine_args, build_engine

DESCRIPTION = """\
Measure how well a drafter (or n-gram lookup) speculates for a target: run the engine over the
first user turn of each prompt and sum its per-step counters. Prints per-position acceptance
(P(at least i+1 drafts accepted), as vLLM's accepted_tokens_per_pos), mean acceptance length
(tokens per target pass that drafted), acceptance rate, drafts, tok/s and, with
--compare-plain, plain-decoding tok/s on the same prompts and the speedup. Greedy by default.
Where the prompts have categories (MT-Bench's eight, HumanEval's "code", GSM8K's "math", a
"category" field in your own records) the same acceptance figures follow per category.
The engine is `specdec bench`'s: the fast path (static KV cache, CUDA graphs) on a CUDA GPU and
for bf16 targets of 50M+ parameters on a CPU (compiled by inductor first, seconds to a minute),
else the reference engine; --reference asks for the reference engine.

examples:
  specdec eval --target smollm2-135m-instruct --drafter runs/quickstart/train/drafter --limit 10
  specdec eval --target smollm2-135m-instruct --ngram 3 --prompts mt-bench --compare-plain
  specdec eval --target smollm2-135m-instruct --drafter DIR --prompts humaneval --limit 20
  specdec eval --target smollm2-135m-instruct --drafter DIR --tree-depth 6 --tree-top-k 8 --json > eval.json
  specdec report eval.json -o reports/eval
  specdec eval --target tiny-llama --ngram 2 --limit 2 --max-new-tokens 16   # CPU-tiny, random weights
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="measure acceptance and speed on a prompt set",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, fast_path=True)
    p.add_argument("--prompts", default="mt-bench", metavar="SOURCE",
                   help="mt-bench (default), humaneval, gsm8k, sharegpt, or a .json/.jsonl file of conversations")
    p.add_argument("--limit", type=int, metavar="N", help="evaluate a random sample of N prompts (seeded)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="per prompt (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed for the prompt sample and for sampling (default: 0)")
    p.add_argument("--compare-plain", action="store_true",
                   help="also decode the same prompts without drafting and report the speedup")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (per_position_acceptance, mean_acceptance_length, "
                        "acceptance_rate, num_drafts, k, tokens_per_s, per_category where the prompts "
                        "have categories, ...) for `specdec report`")
    p.set_defaults(func=run)


def _command_line() -> str | None:
    """The command as typed, when run from the shell (not when main() is called in-process)."""
    import shlex
    from pathlib import Path

    if not sys.argv or Path(sys.argv[0]).name not in ("specdec", "__main__.py"):
        return None
    return "specdec " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _environment(target, args) -> dict:
    import datetime
    import platform

    import torch
    import transformers

    from .. import __version__

    dev = target.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    return {
        "device": str(dev), "device_name": name, "dtype": str(target.dtype).replace("torch.", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command_line(),
        "versions": {"specdec": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }


def print_table(result: dict, title: str, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for i, a in enumerate(result["per_position_acceptance"]):
        table.add_row(f"acceptance at position {i}", f"{a:.1%}")
    table.add_row("mean acceptance length", f"{result['mean_acceptance_length']:.2f}")
    table.add_row("acceptance rate", f"{result['acceptance_rate']:.1%}")
    table.add_row("drafts (target passes that drafted)", str(result["num_drafts"]))
    table.add_row("draft tokens / accepted", f"{result['num_draft_tokens']} / {result['num_accepted_tokens']}")
    table.add_row("new tokens", str(result["new_tokens"]))
    table.add_row("tok/s", f"{result['tokens_per_s']:.1f}")
    if "plain_tokens_per_s" in result:
        table.add_row("tok/s plain decoding", f"{result['plain_tokens_per_s']:.1f}")
        table.add_row("speedup", f"{result['speedup']:.2f}x")
        if "plain_output_mismatches" in result:
            table.add_row("outputs differing from plain (greedy)", str(result["plain_output_mismatches"]))
    Console(file=file or sys.stdout).print(table)


def print_category_table(result: dict, file=None) -> None:
    """One row per prompt category: prompts, drafts, mean acceptance length, per-position acceptance."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="by category")
    for name in ("category", "prompts", "drafts", "mean acceptance length"):
        table.add_column(name, justify="left" if name == "category" else "right")
    table.add_column("% accepted by position", no_wrap=True)  # one line per category
    for row in result["per_category"]:
        table.add_row(row["category"], str(row["num_prompts"]), str(row["num_drafts"]),
                      f"{row['mean_acceptance_length']:.2f}",
                      " ".join(f"{100 * a:3.0f}" for a in row["per_position_acceptance"]))
    Console(file=file or sys.stdout).print(table)


def run(args) -> int:
    from ..data.datasets import load_conversations
    from ..engine.api import SamplingParams
    from ..engine.choice import engine_kind
    from ..errors import SpecdecError
    from ..evaluate import evaluate

    if not args.drafter and args.ngram is None:
        raise SpecdecError("eval needs a drafter: --drafter DIR (EAGLE-3) or --ngram N (prompt lookup)")
    if args.max_new_tokens < 1:
        raise SpecdecError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise SpecdecError(f"--limit must be at least 1, got {args.limit}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SpecdecError("expected --temperature >= 0 and 0 < --top-p <= 1")
    convs = load_conversations(args.prompts, limit=args.limit, seed=args.seed)
    target, engine = build_engine(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    result = evaluate(engine, target.tokenizer, convs, max_new_tokens=args.max_new_tokens,
                      compare_plain=args.compare_plain, progress=not args.no_progress and not args.json,
                      params=params)
    result = {
        "target": args.target, "drafter": args.drafter, "ngram": args.ngram, "prompts": args.prompts,
        "engine": engine_kind(engine),
        **result, **_environment(target, args),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    if result["skipped_prompts"]:
        print(f"skipped {result['skipped_prompts']} prompts that do not fit the engine's context of "
              f"{engine.max_len} tokens with --max-new-tokens {args.max_new_tokens}"
              + (" (the fast path's cache; --reference decodes with the target's whole context)"
                 if result["engine"] == "fast" else ""), file=sys.stderr)
    what = f"drafter {args.drafter}" if args.drafter else f"n-gram lookup (n<={args.ngram})"
    shape = f"tree depth {engine.tree.depth}" if engine.tree else f"k={engine.k}"
    sampling = "greedy" if args.temperature <= 0 else f"T={args.temperature}"
    print_table(result, f"{args.target} + {what}, {args.prompts} ({result['num_prompts']} prompts), "
                        f"{shape}, {sampling}, {result['engine']} engine")
    if result.get("per_category"):
        print_category_table(result)
    return 0
