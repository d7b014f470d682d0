"""`specdec bench`: tokens/s of HF generate, HF prompt lookup and specdec's engines on the same
prompts in one run, with the ratios between them and a check that greedy outputs agree."""

from __future__ import annotations

import argparse

from ..engine.config import FastConfig
from ._engine_args import add_pack_weights_arg, kernel_config

DESCRIPTION = """\
Time the same chat prompts through: HF generate (greedy), HF prompt lookup
(generate(prompt_lookup_num_tokens=N)), with --assistant HF assisted generation
(generate(assistant_model=...)), specdec plain, specdec n-gram and, with --drafter,
specdec EAGLE-3 chains of k = 1..7 drafts and a dynamic tree. specdec rows use the fast path
(static KV cache; Llama/Qwen2/Qwen3/Mistral targets) on a CUDA GPU, in CUDA graphs, and on a CPU
for bf16 targets of 50M+ parameters, compiled by inductor (a C++ compiler needed); elsewhere, or
with --reference, the reference engine. Ratios are taken within this run. Speculative rows also
give their step cost (ms per target pass over plain decoding's) and c/draft, what one drafted
token costs in plain steps: (step cost - 1) / drafted tokens per step, the draft/target cost ratio
that `specdec diagnose --cost-ratio` and the best k read. Prints a table, then one JSON line (with
--json, only the JSON line).

examples:
  specdec bench --target tiny-llama --limit 2 --max-new-tokens 16        # seconds, any CPU
  specdec bench --target smollm2-135m-instruct --prompts mt-bench --limit 10
  specdec bench --target smollm2-135m-instruct --drafter runs/drafter --json > bench.json
  specdec bench --target ./my-model --prompts my_prompts.jsonl --reference --no-hf
  specdec bench --target ./llama-3.1-8b --drafter runs/drafter --k 3,5 --pack-weights   # CUDA, memory to spare
  specdec bench --target qwen2.5-coder-1.5b-instruct --assistant qwen2.5-coder-0.5b-instruct \\
      --drafter runs/qwen/train/drafter --k 2,3 --tree none --limit 5 --max-new-tokens 96
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="tok/s of HF generate vs specdec plain / n-gram / EAGLE-3, same run",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="registry name, local HF folder or .gguf (default: smollm2-135m-instruct)")
    p.add_argument("--drafter", default=None, help="EAGLE-3 drafter folder (adds the EAGLE-3 rows)")
    p.add_argument("--prompts", default="mt-bench",
                   help="built-in set (mt-bench, humaneval, gsm8k, sharegpt) or a .json/.jsonl file "
                        "(default: mt-bench)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="number of prompts (default: 10 on a GPU, 3 on CPU)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="per prompt (default: 256)")
    p.add_argument("--ngram", type=int, default=3, metavar="N", help="longest n-gram matched (default: 3)")
    p.add_argument("--ngram-k", type=int, default=7, metavar="K", help="n-gram draft tokens (default: 7)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10, metavar="N",
                   help="HF prompt_lookup_num_tokens (default: 10)")
    p.add_argument("--k", default="1-7", metavar="LIST", help="EAGLE-3 chain lengths, e.g. 1-7 or 3,5 (default: 1-7)")
    p.add_argument("--tree", default="6,8,48", metavar="D,K,N",
                   help="EAGLE-3 tree depth,top_k,total_tokens; 'none' to skip (default: 6,8,48)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None,
                   help="auto, bf16, fp16 or fp32 (default: bf16 on a GPU, fp32 on CPU; auto: bf16 also on CPUs "
                        "with native bf16)")
    p.add_argument("--reference", action="store_true", help="use the reference engine even where the fast path applies")
    add_pack_weights_arg(p)
    p.add_argument("--eager-drafter", action="store_true",
                   help="fast path: EAGLE-3 chains and trees draft eagerly instead of compiled in CUDA graphs "
                        "(the default, StaticChainDrafter / StaticTreeDrafter, drafts a round many times "
                        "faster)")
    p.add_argument("--assistant", default=None, metavar="MODEL",
                   help="also time HF assisted generation with this draft model (same tokenizer as the "
                        "target), e.g. qwen2.5-coder-0.5b-instruct for a qwen2.5-coder-1.5b-instruct target")
    p.add_argument("--no-hf", action="store_true", help="skip the HF rows")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON result to FILE")
    p.add_argument("--json", action="store_true", help="print exactly one JSON line")
    p.set_defaults(func=run)


def _ks(spec: str) -> tuple[int, ...]:
    from specdec.errors import SpecdecError

    out: list[int] = []
    try:
        for part in spec.split(","):
            if "-" in part:
                a, b = part.split("-")
                out += range(int(a), int(b) + 1)
            elif part.strip():
                out.append(int(part))
    except ValueError as e:
        raise SpecdecError(f"--k expects numbers like 1-7 or 3,5; found {spec!r}") from e
    if not out or min(out) < 1:
        raise SpecdecError(f"--k expects k >= 1; found {spec!r}")
    return tuple(out)


def _tree(spec: str):
    from specdec.engine.tree import TreeConfig
    from specdec.errors import SpecdecError

    if spec.lower() == "none":
        return None
    try:
        d, k, n = (int(x) for x in spec.split(","))
    except ValueError as e:
        raise SpecdecError(f"--tree expects depth,top_k,total_tokens such as 6,8,48; found {spec!r}") from e
    return TreeConfig(depth=d, top_k=k, total_tokens=n)


def run(args) -> int:
    import json
    import sys

    import torch

    from specdec.bench.roofline import device_info
    from specdec.bench.runs import format_table, load_prompts, run_bench
    from specdec.models.target import load_target

    ks, tree = _ks(args.k), _tree(args.tree)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    say = (lambda s: None) if args.json else (lambda s: print(f"[bench] {s}", file=sys.stderr, flush=True))
    say(f"loading {args.target} on {device}")
    target = load_target(args.target, device=device, dtype=args.dtype)
    drafter = None
    if args.drafter:
        from specdec.models.formats import load_drafter

        drafter = load_drafter(args.drafter, target, dtype=target.dtype)
    assistant = None
    if args.assistant and not args.no_hf:
        from specdec.errors import SpecdecError

        say(f"loading the assistant {args.assistant}")
        assistant = load_target(args.assistant, device=device, dtype=args.dtype)
        if len(assistant.tokenizer) != len(target.tokenizer):
            raise SpecdecError(f"--assistant {args.assistant} has a {len(assistant.tokenizer):,}-token tokenizer, "
                               f"the target {len(target.tokenizer):,}; HF assisted generation here needs the "
                               f"same tokenizer (e.g. a smaller model of the same family)")
    limit = args.limit or (10 if device.startswith("cuda") else 3)
    prompts = load_prompts(args.prompts, target.tokenizer, limit)
    say(f"{len(prompts)} prompts from {args.prompts}, {args.max_new_tokens} new tokens each")
    result = run_bench(
        target, prompts, max_new_tokens=args.max_new_tokens, drafter=drafter, ngram=args.ngram,
        ngram_k=args.ngram_k, prompt_lookup_tokens=args.prompt_lookup_tokens, ks=ks, tree=tree,
        fast=False if args.reference else None, hf=not args.no_hf, assistant=assistant,
        config=FastConfig(static_drafter=not args.eager_drafter, kernels=kernel_config(args)), progress=say,
    )
    result.update(target=args.target, drafter=args.drafter, assistant=args.assistant, prompt_source=args.prompts,
                  dtype=str(target.dtype).replace("torch.", ""), env=device_info())
    line = json.dumps(result)
    if args.out:
        from specdec.atomic import write_json

        write_json(args.out, result)
    if not args.json:
        print(format_table(result))
    print(line)
    return 0
