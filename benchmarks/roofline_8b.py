"""Llama-3.1-8B shapes, random bf16 weights built on the GPU (no download): plain decode ms/token
of the fast path against the HBM floor, and the cost of verifying T = 2..16 tokens relative to 1.

Floor = bytes a step must read / measured copy bandwidth (read + write), with the bytes counted
two ways: every weight (16.06 GB, as DESIGN.md states the floor) and what a step actually reads
(the untied embedding table contributes one row). Live KV at --ctx tokens is added to both.

Variants, each a separate compile (torch._dynamo.reset() between them):
    graph      no compile, the eager step captured in one CUDA graph (launch overhead gone)
    cd         inductor + coordinate_descent_tuning (matrix-vector products become tuned
               Triton reductions), one CUDA graph
    nocd       inductor without coordinate-descent tuning (cuBLAS GEMV for one token)
    products   nocd with gemv.py's kernels (one token: norms and residual adds folded into the
               products, SiLU * up too below KernelConfig.glu_fold_max_bytes; 2..16 tokens:
               the rows kernel), attention as compiled ops
    default    products + decode_attention.py's attention kernels for steps of up to 32 query
               rows per kv head (the key rope and cache write stay compiled)   <- the fast path
    autotune   mode="max-autotune-no-cudagraphs" + coordinate descent (Triton GEMM templates
               for the small-M verify matmuls)
A --budget-s guard skips what would not finish; the JSON says what was skipped.

    python benchmarks/roofline_8b.py --out benchmarks/results            # needs ~35 GB of GPU
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

from specdec.bench.roofline import (
    copy_bandwidth, decoder_step_ms, device_info, floor_ms, hf_decode_ms, kernel_step, kv_bytes_per_token,
    llama31_8b_config, random_model, randomize_cache, weight_bytes,
)
from specdec.engine.config import KernelConfig
from specdec.engine.static_decoder import FastDecoder, causal_mask

VARIANTS = {
    "eager": dict(compile=False, cuda_graphs=False),  # CPU smoke runs (--tiny)
    "graph": dict(compile=False, cuda_graphs=True),
    "cd": dict(compile=True, cuda_graphs=True, coordinate_descent=True, gemv=False),
    # What FastEngine picks for these weights: no coordinate descent above 2 GiB, Triton GEMV.
    "default": dict(compile=True, cuda_graphs=True, coordinate_descent=False),
    "nocd": dict(compile=True, cuda_graphs=True, coordinate_descent=False, gemv=False),
    "products": dict(compile=True, cuda_graphs=True, coordinate_descent=False, gemv=True, attention_kernel=False),
    "autotune": dict(compile=True, cuda_graphs=True, coordinate_descent=True, mode="max-autotune-no-cudagraphs"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start nothing new after this")
    ap.add_argument("--ctx", type=int, default=512, help="tokens already in the cache when timing")
    ap.add_argument("--max-len", type=int, default=1024, help="static cache length (attention reads all of it)")
    ap.add_argument("--plan", default="graph:1,8;cd:1;check;hf;cd:8,16,2,4;nocd:1;autotune:8",
                    help="steps in order: VARIANT:T,T,...  |  check (logits vs HF)  |  check_decode (one-token "
                         "steps after a prefill, vs HF)  |  hf (HF eager ms/token)  |  bs=N (attention "
                         "kernel block, default 32)  |  glu=0/1 (SiLU * up never / always folded)  |  "
                         "rows=N (steps of 2..N tokens through the rows kernel, 0: cuBLAS)  |  att=N "
                         "(attention kernels up to N query rows, 0: never)  |  sbs=N (attention block for steps of > 1 "
                         "token)  |  rowscfg=0/1 (rows kernel autotuned over more configs); these hold from the next "
                         "variant on and tag its results")
    ap.add_argument("--tag", default="roofline_8b", help="name of the JSON file written under --out")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny random llama")
    args = ap.parse_args()
    if args.tiny:
        if args.plan == ap.get_default("plan"):
            args.plan = "eager:1,8;check;hf"
        args.ctx, args.max_len = 32, 128
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"env": device_info(), "command": "python " + " ".join(sys.argv),
                 "model": "Llama-3.1-8B shapes, random bf16 weights", "ctx": args.ctx,
                 "max_len": args.max_len, "variants": {}, "skipped": [], "errors": []}

    def save():
        res["elapsed_s"] = time.time() - t_start
        (out / f"{args.tag}.json").write_text(json.dumps(res, indent=2) + "\n")

    bw = copy_bandwidth(64 << 20 if args.tiny else 2 << 30)
    res["copy_bandwidth_TBps"] = bw / 1e12
    if args.tiny:
        from specdec.models.tiny import tiny_config

        cfg, dev, dt = tiny_config("llama"), "cpu", torch.float32
        res["model"] = "tiny random llama (CPU smoke run)"
    else:
        cfg, dev, dt = llama31_8b_config(), "cuda", torch.bfloat16
    t0 = time.time()
    model = random_model(cfg, device=dev, dtype=dt)
    res["build_s"] = time.time() - t0
    wb = weight_bytes(model)
    kv = kv_bytes_per_token(cfg, dt) * args.ctx
    res["bytes"] = {"weights_all": wb["all"], "weights_read": wb["read_per_step"], "kv_live": kv}
    res["floor_ms"] = {"all_weights": floor_ms(wb["all"] + kv, bw),
                       "bytes_read": floor_ms(wb["read_per_step"] + kv, bw)}
    print(f"copy {bw / 1e12:.2f} TB/s; floor {res['floor_ms']['all_weights']:.3f} ms (all weights), "
          f"{res['floor_ms']['bytes_read']:.3f} ms (bytes read)", flush=True)
    dec = FastDecoder(model, max_len=args.max_len, pad=64)
    randomize_cache(dec)
    save()

    current = None
    kernels = KernelConfig()  # as kernel setting steps (glu=, bs=, rows=, att=, ...) leave it
    tags: dict[str, str] = {}  # what those steps changed, appended to result keys
    for step in args.plan.split(";"):
        name, _, ts = step.partition(":")
        if time.time() - t_start > args.budget_s:
            res["skipped"].append(step)
            save()
            continue
        try:
            if (changed := kernel_step(name, kernels, tags)) is not None:
                kernels, current = changed, None
            elif name == "hf":
                res["hf_eager_ms"] = hf_decode_ms(model, prompt_len=args.ctx, steps=12)
                print(f"HF eager {res['hf_eager_ms']:.2f} ms/token", flush=True)
            elif name == "check1":  # one token: the matrix-vector products of the current variant
                res.setdefault("check1", {})[current or "none"] = check_against_hf(model, dec, T=1)
                print(name, current, res["check1"][current or "none"], flush=True)
            elif name == "check_decode":  # one-token steps over a filled cache: the attention kernel
                res.setdefault("check_decode", {})[current or "none"] = check_decode(model, dec)
                print(name, current, res["check_decode"][current or "none"], flush=True)
            elif name in ("check", "check_eager"):
                # check_eager: HF with its eager attention, whose rounding ours mirrors (bf16
                # scores, fp32 softmax); its distance from sdpa's says how much is rounding.
                impl = "eager" if name == "check_eager" else "sdpa"
                try:
                    model.set_attn_implementation(impl)
                except Exception:
                    model.config._attn_implementation = impl
                res[name] = check_against_hf(model, dec)
                res[name]["hf_attention"] = impl
                res.setdefault(f"{name}_by_variant", {})[current or "none"] = res[name]
                print(name, res[name], flush=True)
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
            print(f"step {step} failed: {type(e).__name__}: {e}"[:500], flush=True)
            current = None
        save()
    summarize(res)
    save()
    return 0


@torch.no_grad()
def check_against_hf(model, dec: FastDecoder, T: int = 16) -> dict:
    """Logits of one chain step of T tokens at slot 0 (the current variant, graph or not)
    against HF's forward over the same tokens."""
    ids = torch.randint(0, dec.shapes.vocab, (T,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = model(input_ids=torch.tensor([ids], device=dec.device)).logits[0].float()
    b = dec.step(ids, list(range(T)), 0, causal_mask(T), T)
    got = b.logits[:T].float()
    rel = float((got - ref).norm() / ref.norm())
    agree = int((got.argmax(-1) == ref.argmax(-1)).sum())
    return {"T": T, "rel_err": rel, "argmax_agree": agree, "of": T}


@torch.no_grad()
def check_decode(model, dec: FastDecoder, prefill: int = 16, steps: int = 4) -> dict:
    """A prefill of 16 tokens (one step of 16), then one-token steps each fed HF's argmax, against
    HF's forward over the whole sequence: a key or value cached in the wrong place shows in the
    steps after it."""
    ids = torch.randint(0, dec.shapes.vocab, (prefill,), generator=torch.Generator().manual_seed(8)).tolist()
    dec.step(ids, list(range(prefill)), 0, causal_mask(prefill), prefill)
    rel, agree = [], 0

    def hf_last():
        return model(input_ids=torch.tensor([ids], device=dec.device)).logits[0, -1].float()

    ref = hf_last()
    for t in range(prefill, prefill + steps):
        ids.append(int(ref.argmax()))
        got = dec.step([ids[-1]], [t], t, causal_mask(1), 1).logits[0].float()
        ref = hf_last()  # also the next step's token
        rel.append(float((got - ref).norm() / ref.norm()))
        agree += int(got.argmax() == ref.argmax())
    return {"rel_err": rel, "argmax_agree": agree, "of": len(rel)}


def summarize(res: dict) -> None:
    floor = res["floor_ms"]["all_weights"]
    v = res["variants"]
    summary = {}
    for name, rows in v.items():
        one = rows.get("1", {}).get("ms")
        s = {}
        if one:
            s["decode_ms"] = one
            s["pct_of_floor"] = 100 * floor / one
            s["pct_of_floor_bytes_read"] = 100 * res["floor_ms"]["bytes_read"] / one
            s["verify_ratio"] = {T: r["ms"] / one for T, r in rows.items() if T != "1"}
        summary[name] = s
    res["summary"] = summary
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())
