"""Greedy agreement of the fast path on the GPU, compiled and in CUDA graphs:
  * logits against HF's forward (fp32 with TF32 off, and bf16): ||fast - hf|| / ||hf||;
  * token identity of FastEngine (plain and n-gram) against the reference engine (fp32) and
    against HF generate (bf16), with the first divergence and the reference's top-2 logit gap there.

SmolLM2-135M shapes with random weights (the real GGUF cannot travel to the device in one call),
with the final norm scaled by --sharpen so logits have real margins: in a random model top-2 gaps
are tiny and any rounding difference flips a token, which says nothing about correctness.

    python benchmarks/agreement.py --out benchmarks/results
    python benchmarks/agreement.py --tiny      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from specdec.bench.roofline import device_info, random_model, smollm2_135m_config
from specdec.engine.api import SamplingParams
from specdec.engine.config import FastConfig
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.fast import FastEngine
from specdec.engine.static_decoder import causal_mask
from specdec.models.target import Target


@torch.no_grad()
def logits_check(target: Target, eng: FastEngine, n: int = 24) -> dict:
    dec = eng.fast
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, target.vocab_size, (n + 1,), generator=g).tolist()
    ref = target.model(input_ids=torch.tensor([ids], device=target.device)).logits[0].float()
    rows = []
    C = eng.prefill_chunk
    for start in range(0, n, C):
        chunk = ids[start : min(n, start + C)]
        b = dec.step(chunk, list(range(start, start + len(chunk))), start, causal_mask(C), C)
        rows.append(b.logits[: len(chunk)].float().clone())
    b = dec.step([ids[n]], [n], n, causal_mask(1), 1)  # one decode step through bucket 1
    rows.append(b.logits[:1].float().clone())
    got = torch.cat(rows)
    return {"tokens": n + 1, "rel_err": float((got - ref).norm() / ref.norm()),
            "max_abs_err": float((got - ref).abs().max()), "logit_std": float(ref.std()),
            "argmax_agree": int((got.argmax(-1) == ref.argmax(-1)).sum())}


@torch.no_grad()
def gap_at(target: Target, prompt: list[int], tokens: list[int], d: int) -> float:
    """Reference top-2 logit gap where two greedy outputs first differ."""
    ids = torch.tensor([prompt + tokens[:d]], device=target.device)
    top = target.model(input_ids=ids).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def compare(target, want: list[list[int]], got: list[list[int]], prompts) -> dict:
    same, first, gaps = 0, [], []
    for p, a, b in zip(prompts, want, got):
        if a == b:
            same += 1
            continue
        d = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
        first.append(d)
        gaps.append(gap_at(target, p, a, d))
    return {"identical": same, "of": len(want), "first_divergence": first, "ref_top2_gap_there": gaps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--sharpen", type=float, default=30.0)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"env": device_info(), "command": "python " + " ".join(sys.argv), "sharpen": args.sharpen,
                 "model": "SmolLM2-135M shapes, random weights, final norm x sharpen", "results": {}, "errors": []}

    def save():
        res["elapsed_s"] = time.time() - t0
        (out / "agreement.json").write_text(json.dumps(res, indent=2) + "\n")

    if args.tiny:
        from specdec.models.tiny import tiny_config

        cfg = tiny_config("llama")
    else:
        cfg = smollm2_135m_config()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        r: dict = {}
        res["results"][name] = r
        try:
            model = random_model(cfg, device=dev, dtype=dtype, seed=1)
            with torch.no_grad():
                model.model.norm.weight.mul_(args.sharpen)
            target = Target(model, None, name=f"smollm2-shapes-{name}")
            config = FastConfig(require_cuda=dev == "cuda", max_len=512, prefill_chunk=8)
            plain = FastEngine(target, config=config)
            ngram = FastEngine(target, ngram=3, k=7, decoder=plain.fast, config=config)
            plain.warmup(), ngram.warmup()
            r["compiled"], r["cuda_graphs"] = plain.fast.compiled, plain.fast.use_graphs
            r["logits_vs_hf_forward"] = logits_check(target, plain)
            print(name, "logits", r["logits_vs_hf_forward"], flush=True)
            save()
            g = torch.Generator().manual_seed(5)
            prompts = [torch.randint(0, target.vocab_size, (48,), generator=g).tolist() for _ in range(args.prompts)]
            params = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
            if dtype == torch.float32:
                ref = SpeculativeEngine(target)
                want = [ref.generate(p, params).token_ids for p in prompts]
                r["reference"] = "specdec reference engine (HF forward, DynamicCache), fp32"
            else:
                from specdec.bench.runs import hf_generate

                run = hf_generate(target)
                want = [run(p, args.new)[0] for p in prompts]
                r["reference"] = "HF generate, bf16"
            got_plain = [plain.generate(p, params).token_ids for p in prompts]
            got_ngram = [ngram.generate(p, params).token_ids for p in prompts]
            r["plain"] = compare(target, want, got_plain, prompts)
            r["ngram"] = compare(target, want, got_ngram, prompts)
            r["ngram_vs_plain_identical"] = sum(a == b for a, b in zip(got_plain, got_ngram))
            print(name, {k: v for k, v in r.items() if k in ("plain", "ngram", "ngram_vs_plain_identical")}, flush=True)
            del plain, ngram, target, model
        except Exception as e:
            res["errors"].append({"dtype": name, "error": f"{type(e).__name__}: {e}"[:2000],
                                  "trace": traceback.format_exc()[-3000:]})
            print(f"{name} failed: {type(e).__name__}: {e}"[:800], flush=True)
        torch._dynamo.reset()
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
