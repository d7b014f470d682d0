"""Plain decoding of SmolLM2-135M-Instruct on this CPU (bf16): the reference engine against the
CUDA fast path's decoder (`FastEngine`, static cache, fused QKV and gate/up) run on the CPU, eager
and compiled by inductor's CPU backend. `make_engine` picks the reference engine on a CPU; this
measures what a CPU fast path would give.

    python benchmarks/cpu_fast_path.py

Prints tok/s for 3 MT-Bench first turns x 64 new tokens (greedy), after one warm-up generation.
"""

from __future__ import annotations

import time

from specdec.data.chat import prompt_ids
from specdec.data.datasets import load_conversations
from specdec.engine.api import SamplingParams
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.fast import FastEngine
from specdec.evaluate import first_turn
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
    target = load_target("smollm2-135m-instruct", device="cpu", dtype="bf16")
    convs = load_conversations("mt-bench", limit=3, seed=0)
    prompts = [prompt_ids(target.tokenizer, first_turn(c.messages if hasattr(c, "messages") else c))
               for c in convs]
    ref = tok_s("reference engine", SpeculativeEngine(target), prompts)
    fast = FastEngine(target, require_cuda=False, max_len=512)
    eager = tok_s("fast decoder, eager", fast, prompts)
    fast.fast.optimize(compile=True, cuda_graphs=False, coordinate_descent=False)
    compiled = tok_s("fast decoder, compiled", fast, prompts)
    print("same tokens as the reference engine: eager", eager == ref, "compiled", compiled == ref)


if __name__ == "__main__":
    main()
