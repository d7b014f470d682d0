"""Regeneration throughput: HF `generate` on left-padded batches against engine/batch.py's
BatchDecoder (static cache; a CUDA graph per decode step on CUDA), on the same batches of the same
prompts, alternating which goes first; how many answers come out token for token the same.

  python benchmarks/regen_throughput.py --target smollm2-135m-instruct --prompts sharegpt --limit 512 \\
      --batch-size 256 --max-new-tokens 256 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec.data.chat import prompt_ids
from specdec.data.datasets import load_conversations
from specdec.data.regenerate import RegenConfig, generate_batch
from specdec.engine.batch import BatchDecoder
from specdec.models.target import load_target


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="sharegpt")
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-chars", type=int, default=2000, help="skip longer first turns")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    target = load_target(args.target, dtype=args.dtype)
    tok = target.tokenizer
    convs = [c for c in load_conversations(args.prompts, limit=None)
             if c.messages and len(c.messages[0]["content"]) <= args.max_prompt_chars][: args.limit]
    prompts = sorted((prompt_ids(tok, c.messages[:1]) for c in convs), key=len, reverse=True)
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    cfg = RegenConfig(max_new_tokens=args.max_new_tokens)
    eos, pad = list(target.eos_token_ids), tok.pad_token_id or 0
    dec = BatchDecoder(target.model)
    # Warm-up on the first batch's shape: CUDA context, kernels, the first graph capture.
    dec.generate(batches[0][:2], 4, eos, pad)
    generate_batch(target, batches[0][:2], RegenConfig(max_new_tokens=4))
    totals = {"hf": [0, 0.0], "batch": [0, 0.0]}
    same = rows = 0
    for n, b in enumerate(batches):
        runs = [("hf", lambda: generate_batch(target, b, cfg)),
                ("batch", lambda: dec.generate(b, cfg.max_new_tokens, eos, pad))]
        outs = {}
        for name, fn in (runs if n % 2 == 0 else runs[::-1]):
            outs[name], s = timed(fn)
            totals[name][0] += sum(len(t) for t, _ in outs[name])
            totals[name][1] += s
        same += sum(a == c for a, c in zip(outs["hf"], outs["batch"]))
        rows += len(b)
        line = {k: round(v[0] / v[1], 1) for k, v in totals.items()}
        print(f"batch {n + 1}/{len(batches)}: {len(b)} prompts of <= {len(b[0])} tokens; tok/s so far {line}",
              flush=True)
    res = {
        "target": args.target, "device": str(target.device), "dtype": str(target.dtype), "prompts": rows,
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
        "hf_tok_s": totals["hf"][0] / totals["hf"][1], "batch_tok_s": totals["batch"][0] / totals["batch"][1],
        "hf_tokens": totals["hf"][0], "batch_tokens": totals["batch"][0], "identical_answers": same,
        "torch": torch.__version__,
    }
    res["speedup"] = res["batch_tok_s"] / res["hf_tok_s"]
    print(json.dumps(res))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "regen_throughput.jsonl", "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
