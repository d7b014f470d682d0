"""`specdec regenerate`: the target answers its own prompts (self-distillation data)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
The target answers each conversation's user turns, turn by turn (every assistant turn is replaced
by the target's own answer; --single-turn asks only the first user turn). A drafter trained on
the target's own answers learns what the target will say, not what ChatGPT once said.

In process: batched plain decoding of left-padded batches, longest prompts first. Batches of a
Llama-family target (Llama, Qwen2/3, Mistral, SmolLM2), greedy or sampled, run on a static cache
with every decode step one CUDA graph (many times HF generate's throughput); other architectures
run HF generate (--hf-generate forces it).
With --endpoint: any OpenAI-compatible server (vLLM, SGLang, specdec serve), --concurrency
requests in flight, retries with exponential backoff on connection errors, 429 and 5xx.

Output: one JSON line per finished conversation, fsynced:
  {"id", "messages", "target", "finish_reason", "new_tokens", "finish_reasons"}
Rerunning the same command resumes: finished ids are skipped and a line torn by a kill is
dropped. Prompt sources: sharegpt, mt-bench, humaneval, gsm8k, a local .json/.jsonl, or self.

--prompts self: the target writes the prompts too (the Magpie method): it is shown only its chat
template's user-turn header and samples a user message, --limit of them, which are filtered (length,
non-printable or mostly non-letter text, non-ASCII language, exact and near duplicates) and appended
to OUT.self-prompts.jsonl next to the output; a rerun continues that file. --self-topics spreads the
prompts over topics (named in a system message, round-robin). Needs --target (in process).

examples:
  specdec regenerate --target tiny-llama --prompts mt-bench --limit 4 --max-new-tokens 16 -o /tmp/regen.jsonl
  specdec regenerate --target smollm2-135m-instruct --prompts sharegpt --limit 10000 \\
      --batch-size 256 -o runs/smol/regen.jsonl
  specdec regenerate --endpoint http://localhost:8000 --prompts sharegpt --limit 10000 \\
      --concurrency 64 -o runs/big/regen.jsonl          # vLLM / SGLang already serving the target
  specdec regenerate --target smollm2-135m-instruct --prompts self --limit 200 -o runs/smol/regen.jsonl
  specdec regenerate --target smollm2-135m-instruct --prompts self --self-topics "code,math,writing" \\
      --limit 1000 -o runs/smol/regen.jsonl             # prompts in runs/smol/regen.self-prompts.jsonl
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "regenerate",
        help="the target answers its own prompts (self-distillation data for training)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", metavar="T", help="registry name, HF folder or .gguf (in-process mode)")
    p.add_argument("--prompts", required=True, metavar="SOURCE",
                   help="sharegpt, mt-bench, humaneval, gsm8k, a local .json/.jsonl file, or self (the target "
                        "writes the prompts; needs --limit)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.jsonl", help="JSONL to append to (resumed)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="random sample of N conversations")
    p.add_argument("--seed", type=int, default=0, help="seed of the --limit sample and of sampling (default: 0)")
    p.add_argument("--single-turn", action="store_true", help="answer only the first user turn")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="per answer (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    g = p.add_argument_group("in-process generation")
    g.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="conversations per batch (default: 256 on a GPU, 32 on the CPU)")
    g.add_argument("--hf-generate", action="store_true",
                   help="decode with HF generate instead of the batch decoder (static cache, CUDA graphs)")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="model dtype (default: bf16 on GPU, fp32 on CPU)")
    g.add_argument("--device-map", default=None, metavar="MAP", help="e.g. auto, to spread a large target over GPUs")
    e = p.add_argument_group("OpenAI-compatible endpoint")
    e.add_argument("--endpoint", metavar="URL", help="e.g. http://localhost:8000 (uses /v1/chat/completions)")
    e.add_argument("--model", metavar="NAME", help="served model name (default: the first of GET /v1/models)")
    e.add_argument("--concurrency", type=int, default=8, metavar="N", help="requests in flight (default: 8)")
    e.add_argument("--api-key", default=None, metavar="KEY", help="bearer token (default: $OPENAI_API_KEY)")
    e.add_argument("--max-retries", type=int, default=6, metavar="N",
                   help="retries per request on connection errors, 429 and 5xx (default: 6)")
    e.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS", help="per request (default: 600)")
    s = p.add_argument_group("prompts written by the target (--prompts self)")
    s.add_argument("--self-topics", default=None, metavar="LIST|FILE|broad",
                   help='comma-separated topics, a file with one per line (e.g. "code,math,writing"), or '
                        "broad (the quickstart's twelve, from programming to everyday advice); default: none "
                        "(plain Magpie)")
    s.add_argument("--self-max-tokens", type=int, default=128, metavar="N",
                   help="per prompt; a prompt cut off at this limit is dropped (default: 128)")
    s.add_argument("--self-temperature", type=float, default=1.0, metavar="T", help="prompt sampling (default: 1.0)")
    s.add_argument("--self-top-p", type=float, default=0.99, metavar="P", help="prompt sampling (default: 0.99)")
    s.add_argument("--self-min-chars", type=int, default=10, metavar="N",
                   help="shorter prompts are dropped (default: 10)")
    s.add_argument("--self-max-chars", type=int, default=2000, metavar="N",
                   help="longer prompts are dropped (default: 2000)")
    s.add_argument("--self-min-ascii", type=float, default=0.9, metavar="SHARE",
                   help="least share of ASCII among a prompt's letters, a cheap language check; 0 = off "
                        "(default: 0.9)")
    s.add_argument("--self-near-duplicate", type=float, default=0.7, metavar="J",
                   help="drop a prompt whose word 3-grams have Jaccard >= J with a kept one; above 1 = off "
                        "(default: 0.7)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    p.set_defaults(func=run)


def run(args) -> int:
    import os

    from specdec.data.datasets import load_conversations
    from specdec.data.regenerate import RegenConfig, regenerate_endpoint, regenerate_local
    from specdec.data.self_prompts import SOURCE_NAME
    from specdec.errors import SpecdecError

    if not args.endpoint and not args.target:
        raise SpecdecError("expected --target T (generate in process) or --endpoint URL (a running server)")
    if args.batch_size is not None and args.batch_size < 1:
        raise SpecdecError(f"--batch-size must be >= 1, found {args.batch_size}")
    if args.max_new_tokens < 1:
        raise SpecdecError(f"--max-new-tokens must be >= 1, found {args.max_new_tokens}")
    own_prompts = args.prompts == SOURCE_NAME
    if own_prompts:
        _check_self_args(args)
    elif args.self_topics:
        raise SpecdecError(f"--self-topics applies only with --prompts {SOURCE_NAME}")
    convs = None if own_prompts else load_conversations(args.prompts, limit=args.limit, seed=args.seed)
    cfg = RegenConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                      seed=args.seed, single_turn=args.single_turn)
    progress = not args.no_progress
    if args.endpoint:
        summary = regenerate_endpoint(
            args.endpoint, convs, args.output, cfg, model=args.model, concurrency=args.concurrency,
            api_key=args.api_key or os.environ.get("OPENAI_API_KEY"), max_retries=args.max_retries,
            timeout_s=args.timeout, progress=progress,
        )
    else:
        from specdec.models.target import load_target

        target = load_target(args.target, device=args.device, dtype=args.dtype, device_map=args.device_map)
        batch = args.batch_size or (256 if target.device.type == "cuda" else 32)
        if own_prompts:
            convs = _write_own_prompts(target, args, batch, progress)
        summary = regenerate_local(target, convs, args.output, cfg, batch_size=batch, progress=progress,
                                   fast=False if args.hf_generate else None)
    print(summary.line())
    print(f"wrote {args.output}; next: specdec capture --target {args.target or 'T'} --data {args.output} -o DIR")
    return 0


def _check_self_args(args) -> None:
    from specdec.errors import SpecdecError

    if args.endpoint:
        raise SpecdecError("--prompts self needs --target: the prompts are sampled from the raw chat template "
                           "(a user-turn header), which /v1/chat/completions cannot do; write them in process "
                           "with --target T, or pass the prompts file of such a run to --prompts")
    if args.limit is None or args.limit < 1:
        raise SpecdecError(f"--prompts self needs --limit N >= 1 (how many prompts to write), found {args.limit}")
    if args.self_max_tokens < 1:
        raise SpecdecError(f"--self-max-tokens must be >= 1, found {args.self_max_tokens}")
    if args.self_temperature <= 0:
        raise SpecdecError(f"--self-temperature must be > 0 (greedy would write one prompt), found "
                           f"{args.self_temperature}")


def _write_own_prompts(target, args, batch: int, progress: bool) -> list:
    from specdec.data.self_prompts import PromptFilter, SelfPromptConfig, parse_topics, self_prompt_conversations

    cfg = SelfPromptConfig(
        limit=args.limit, seed=args.seed, max_new_tokens=args.self_max_tokens, temperature=args.self_temperature,
        top_p=args.self_top_p, batch_size=batch, topics=parse_topics(args.self_topics),
        filter=PromptFilter(min_chars=args.self_min_chars, max_chars=args.self_max_chars,
                            min_ascii_share=args.self_min_ascii, near_duplicate=args.self_near_duplicate),
    )
    return self_prompt_conversations(target, args.output, cfg, progress=progress)
