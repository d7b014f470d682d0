"""Where the 8B-shaped decode step's time goes, and whether a hand-written GEMV beats cuBLAS's.

Two measurements on the GPU, written to --out as JSON:

1. The fast path's one-token step (inductor without coordinate descent, its Triton kernels), run without
   a CUDA graph under torch.profiler: GPU time per kernel family (matrix-vector products,
   attention, norms and other fused elementwise kernels), per step, next to the graph replay's
   wall time. The floor is set by the products; everything else is overhead to fuse away.
2. engine/gemv.py's GEMV kernel (each program streams BLOCK_N full rows) at every block size it
   autotunes over, against F.linear, for the step's weight shapes, as effective bandwidth in TB/s
   against the measured copy bandwidth.

    python benchmarks/profile_8b.py --out $OUT          # H200, ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.bench.roofline import (
    copy_bandwidth, decoder_step_ms, device_info, llama31_8b_config, random_model, randomize_cache, time_cuda,
)
from specdec.engine.static_decoder import FastDecoder, causal_mask


def family(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemv", "gemm", "cutlass", "sm90", "nvjet", "splitk", "_rows_kernel")):
        return "matmul"
    if "flash" in n or "attention" in n or "fmha" in n or "sdpa" in n or n in ("_split_kernel", "_combine_kernel"):
        return "attention"
    if "triton" in n:
        return "triton (fused norms, rope, cache, elementwise)"
    return "other"


def profile_step(dec: FastDecoder, ctx: int, steps: int = 20, T: int = 1) -> dict:
    b = dec.stage([5] * T, list(range(ctx, ctx + T)), ctx, causal_mask(T), T)
    for _ in range(3):
        dec.run_eager(b)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.run_eager(b)
        torch.cuda.synchronize()
    per_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            per_kernel[e.name][0] += us / 1e3 / steps  # ms per step
            per_kernel[e.name][1] += 1
    fam: dict[str, float] = defaultdict(float)
    count: dict[str, float] = defaultdict(float)
    for name, (ms, n) in per_kernel.items():
        fam[family(name)] += ms
        count[family(name)] += n / steps
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    return {"gpu_ms_per_step": sum(fam.values()), "families_ms": dict(fam), "kernels_per_step": dict(count),
            "top_kernels": [{"name": k[:160], "ms": round(v[0], 4), "calls_per_step": v[1] / steps} for k, v in top]}


def triton_gemv():
    """engine/gemv.py's one-token kernel at fixed block sizes, no norm or residual folded in."""
    import triton

    from specdec.engine.gemv import _gemv_kernel

    def run(w, x, y, block_n, block_k, warps, stages):
        n, k = w.shape
        _gemv_kernel[(triton.cdiv(n, block_n),)](w, x, y, x, x, n, 0.0, k, NORM=False, RESIDUAL=False, GLU=False,
                                                 LBN=0, LBK=0, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                                 num_stages=stages)
    return run


def graph_ms(fn, ws: list, reps: int = 4) -> float:
    """Kernel time per call: `len(ws) * reps` calls captured in one CUDA graph, so neither Python
    nor launch latency is counted (the engine replays its steps as graphs too), and the weights
    rotate through enough copies to come from HBM, not from the 50 MB L2."""
    fn(ws[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for w in ws:
                fn(w)
    return time_cuda(g.replay, iters=5)["ms"] / (reps * len(ws))


def gemv_table(bw: float, budget_s: float) -> list[dict]:
    if budget_s <= 0:
        return []
    run = triton_gemv()
    t0 = time.time()
    rows = []
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    for name, (n, k) in shapes.items():
        copies = max(2, int(1e9 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        ref = graph_ms(lambda w: F.linear(x, w), ws)
        row = {"shape": name, "N": n, "K": k, "cublas_ms": ref, "cublas_TBps": n * k * 2 / ref / 1e9}
        best = None
        for bn in (2, 4, 8, 16):
            for bk in (512, 1024):
                for warps in (4, 8):
                    if time.time() - t0 > budget_s:
                        break
                    try:
                        run(ws[0], x[0], y, bn, bk, warps, 1)
                        torch.testing.assert_close(y.float(), F.linear(x, ws[0])[0].float(), rtol=2e-2, atol=2e-2)
                        ms = graph_ms(lambda w: run(w, x[0], y, bn, bk, warps, 1), ws)
                    except Exception as e:  # an illegal config (registers, shared memory): skip it
                        row.setdefault("errors", []).append(f"{bn}/{bk}/{warps}: {type(e).__name__}: {e}"[:200])
                        continue
                    if best is None or ms < best[0]:
                        best = (ms, bn, bk, warps)
        if best:
            row.update(triton_ms=best[0], triton_TBps=n * k * 2 / best[0] / 1e9,
                       triton_config=dict(block_n=best[1], block_k=best[2], warps=best[3]))
        row["copy_TBps"] = bw / 1e12
        print(json.dumps(row), flush=True)
        rows.append(row)
        del ws
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--gemv-budget-s", type=float, default=120)
    ap.add_argument("--profiles", default="default@1",
                    help="steps to profile, VARIANT@T comma-separated: default (the fast path) or products "
                         "(its attention compiled, not decode_attention's kernels), T tokens per step")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"env": device_info(), "command": "python " + " ".join(sys.argv)}
    bw = copy_bandwidth(2 << 30)
    res["copy_bandwidth_TBps"] = bw / 1e12
    try:
        res["gemv"] = gemv_table(bw, args.gemv_budget_s)
    except Exception as e:  # the profile below does not depend on it
        res["gemv_error"] = f"{type(e).__name__}: {e}"
        print(res["gemv_error"], flush=True)
    (out / "profile_8b.json").write_text(json.dumps(res, indent=2) + "\n")

    model = random_model(llama31_8b_config(), device="cuda", dtype=torch.bfloat16)
    dec = FastDecoder(model, max_len=args.max_len, pad=64)
    randomize_cache(dec)
    for entry in args.profiles.split(","):
        variant, _, T = entry.partition("@")
        t0 = time.time()
        torch._dynamo.reset()
        dec.optimize(compile=True, cuda_graphs=False, coordinate_descent=False,
                     attention_kernel=None if variant == "default" else False)
        prof = profile_step(dec, args.ctx, T=int(T or 1))
        prof["compile_s"] = time.time() - t0
        res.setdefault("profiles", {})[entry] = prof
        res.setdefault("profile", prof)  # the first, under the key earlier runs used
        print(entry, json.dumps({k: v for k, v in prof.items() if k != "top_kernels"}), flush=True)
        (out / "profile_8b.json").write_text(json.dumps(res, indent=2) + "\n")
    torch._dynamo.reset()
    dec.optimize(compile=True, cuda_graphs=True, coordinate_descent=False)
    dec.warmup([1])
    res["graph_step_ms"] = decoder_step_ms(dec, 1, slot0=args.ctx)["ms"]
    print(f"graph step {res['graph_step_ms']:.3f} ms", flush=True)
    (out / "profile_8b.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
