"""Decoding SmolLM2-135M-Instruct on this CPU: the reference engine against the CUDA fast path's
decoder (`FastEngine`, static cache, fused QKV and gate/up) run on the CPU, eager and compiled by
inductor's CPU backend (what `make_engine` now picks for bf16 targets of 50M+ parameters). With
--drafter, EAGLE-3 chains of --k drafts too: on the reference engine, on the compiled fast path
with the eager proposer (`make_engine`'s choice), and with `StaticChainDrafter` compiled by
inductor (no CUDA graphs on a CPU).

    python benchmarks/cpu_fast_path.py
    python benchmarks/cpu_fast_path.py --drafter runs/gpu_k/drafter-home --k 3
    python benchmarks/cpu_fast_path.py --dtype fp32 --drafter runs/gpu_k/drafter-home --k 2

Prints tok/s for 3 MT-Bench first turns x 64 new tokens (greedy), after one warm-up generation.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from specdec.data.chat import prompt_ids
from specdec.data.datasets import load_conversations
from specdec.engine.api import SamplingParams
from specdec.engine.config import FastConfig
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.eagle_graph import StaticChainDrafter
from specdec.engine.fast import FastEngine
from specdec.evaluate import first_turn
from specdec.models.formats import load_drafter
from specdec.models.target import load_target


def tok_s(name: str, engine, prompts: list[list[int]]) -> list[list[int]]:
    start = time.perf_counter()
    engine.generate(prompts[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    warm = time.perf_counter() - start
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    start, n, tokens = time.perf_counter(), 0, []
    for p in prompts:
        r = engine.generate(p, params)
        n += r.new_tokens
        tokens.append(r.token_ids)
    print(f"{name:26s} {n / (time.perf_counter() - start):6.1f} tok/s (warm-up {warm:.0f} s)", flush=True)
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--drafter", help="an EAGLE-3 drafter folder for SmolLM2: also time chains of --k drafts")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=512,
                    help="the fast decoder's static cache (every step attends all of it; eval and serve "
                         "size it to the model, up to 2048)")
    args = ap.parse_args()
    target = load_target("smollm2-135m-instruct", device="cpu", dtype=args.dtype)
    convs = load_conversations("mt-bench", limit=3, seed=0)
    prompts = [prompt_ids(target.tokenizer, first_turn(c.messages if hasattr(c, "messages") else c))
               for c in convs]
    ref = tok_s("reference engine", SpeculativeEngine(target), prompts)
    config = FastConfig(require_cuda=False, max_len=args.max_len)
    fast = FastEngine(target, config=config)
    eager = tok_s("fast decoder, eager", fast, prompts)
    fast.fast.optimize(compile=True, cuda_graphs=False, coordinate_descent=False)
    compiled = tok_s("fast decoder, compiled", fast, prompts)
    print("same tokens as the reference engine: eager", eager == ref, "compiled", compiled == ref)
    if not args.drafter:
        return
    drafter = load_drafter(args.drafter, target, dtype=target.dtype)
    k = args.k
    tok_s(f"reference, EAGLE-3 k={k}", SpeculativeEngine(target, drafter=drafter, k=k), prompts)
    chain = dict(decoder=fast.fast, drafter=drafter, k=k)
    eager = FastEngine(target, config=replace(config, static_drafter=False), **chain)
    a = tok_s(f"compiled, EAGLE-3 k={k}, eager", eager, prompts)
    static = FastEngine(target, config=config, **chain)
    static.static = StaticChainDrafter(drafter, k=k, max_len=static.max_len, cuda_graphs=False, compile=True)
    b = tok_s(f"compiled, EAGLE-3 k={k}, static", static, prompts)
    print("same tokens, eager proposer and StaticChainDrafter:", a == b)


if __name__ == "__main__":
    main()
