"""`specdec doctor`: find the convention mismatch behind a collapsed acceptance rate."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Measures the drafter's acceptance with the engine on a few prompts as configured, then once per
hypothesis: aux layer ids shifted by -1 / +1 (EAGLE vs SpecForge/ModelOpt/SGLang id counting), the
last state taken after the final norm, norm_before_residual flipped, an identity d2t. A hypothesis
that clearly beats the configured drafter names the mismatch and how to fix it. Run it when
`specdec diagnose` reports low position-0 acceptance.

examples:
  specdec doctor --target smollm2-135m-instruct --drafter runs/quickstart/train/drafter
  specdec doctor --target meta-llama/Llama-3.1-8B-Instruct --drafter ./eagle3-drafter --prompts mt-bench --limit 5 --json
"""  # noqa: E501 (--help prints this verbatim: the example command stays on one line)


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="name the mismatch that kills a drafter's acceptance",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True, metavar="DIR")
    p.add_argument("--prompts", default="mt-bench", help="prompt source (default: mt-bench)")
    p.add_argument("--limit", type=int, default=3, help="prompts to run per hypothesis (default: 3)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--device")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from ..data.datasets import load_conversations
    from ..doctor import diagnose_drafter
    from ..models.formats import load_drafter
    from ..models.target import load_target

    target = load_target(args.target, device=args.device)
    drafter = load_drafter(args.drafter, target, dtype=target.dtype)
    convs = load_conversations(args.prompts, limit=args.limit, seed=0)
    result = diagnose_drafter(target, drafter, target.tokenizer, convs, k=args.k,
                              max_new_tokens=args.max_new_tokens, progress=not args.json)
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"specdec doctor: {args.drafter} on {args.target} (k={args.k})")
    table.add_column("hypothesis")
    table.add_column("mean acceptance length", justify="right")
    table.add_column("per position")
    for r in result["rows"]:
        table.add_row(r["hypothesis"], f"{r['mean_acceptance_length']:.2f}",
                      " ".join(f"{a:.2f}" for a in r["per_position_acceptance"]))
    console = Console()
    console.print(table)
    console.print(result["verdict"])
    return 0
