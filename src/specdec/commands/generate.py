"""`specdec generate`: one prompt through the engine, plain or speculative."""

from __future__ import annotations

import argparse
import json

from ._engine_args import add_engine_args, build_engine

DESCRIPTION = """\
Generate a chat answer with the target, optionally speculating with an EAGLE-3 drafter or
n-gram prompt lookup. Greedy speculative output is token-identical to plain decoding; the
acceptance statistics say how much the drafter helped.

examples:
  specdec generate --target smollm2-135m-instruct --prompt "Explain what a hash table is."
  specdec generate --target smollm2-135m-instruct --ngram 3 --prompt "Explain what a hash table is."
  specdec generate --target smollm2-135m-instruct --drafter runs/quickstart/drafter --k 5 --json \\
      --prompt "Write a haiku about caches."
  specdec generate --target tiny-llama --prompt hi --max-new-tokens 8     # CPU-tiny, random weights
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text for one prompt (plain or speculative)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", help="optional system message")
    p.add_argument("--raw", action="store_true", help="use the prompt as raw text, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="seed for sampling (temperature > 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and statistics")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..data.chat import prompt_ids
    from ..engine.api import SamplingParams
    from ..errors import SpecdecError

    if args.max_new_tokens < 1:
        raise SpecdecError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise SpecdecError("expected --temperature >= 0 and 0 < --top-p <= 1")
    target, engine = build_engine(args)
    tok = target.tokenizer
    if args.raw:
        ids = tok(args.prompt, add_special_tokens=True)["input_ids"]
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        ids = prompt_ids(tok, messages)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    result = engine.generate(ids, params)
    text = tok.decode(result.token_ids, skip_special_tokens=True)
    stats = result.stats()
    if args.json:
        print(json.dumps({"text": text, "mode": engine.mode, **stats,
                          "per_position_acceptance": stats["per_position_acceptance"]}))
        return 0
    print(text)
    import sys

    line = (f"[{engine.mode}] {stats['new_tokens']} tokens in {stats['seconds']:.2f}s "
            f"({stats['tokens_per_s']:.1f} tok/s)")
    if result.drafted:
        pp = " ".join(f"{p:.2f}" for p in stats["per_position_acceptance"])
        line += (f"; drafted {result.drafted}, accepted {result.accepted} "
                 f"({stats['acceptance_rate']:.1%}); mean acceptance length {stats['mean_acceptance_length']:.2f}; "
                 f"per position [{pp}]")
    print(line, file=sys.stderr)
    return 0
