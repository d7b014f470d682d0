"""The rows kernel's block sizes on Llama-3.1-8B's five product shapes, one config at a time.

A verify step of 8 tokens through `engine/gemv.py`'s rows kernel cost 4.56 ms in one H200 call and
5.00 in the next, with the same code; the one-token step 4.17 and 4.22. The kernel is autotuned
per shape in each process, so this times every config of its autotune set outside torch.compile
(`triton.testing.do_bench`, L2 flushed between runs) next to the one-token GEMV and cuBLAS on the
same weights, then lets the autotuner pick several times afresh: a spread between configs and
picks that change from run to run would explain the calls. Each time includes the launch from
Python, which dominates the small products (the one-token GEMV most); compare configs with each
other, and the large products (gate/up, lm_head) with the copy bandwidth.

    python benchmarks/rows_configs.py --out benchmarks/results     # H200, ~2 GB of GPU memory
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from specdec.bench.roofline import device_info
from specdec.engine import gemv

# (name, rows N, columns K, RMSNorm folded, residual add folded): one layer's products and the head.
SHAPES = [("qkv", 6144, 4096, True, False), ("o", 4096, 4096, False, True), ("gate_up", 28672, 4096, True, False),
          ("down", 4096, 14336, False, True), ("lm_head", 128256, 4096, True, False)]


def main() -> int:
    import triton
    from triton.testing import do_bench

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--picks", type=int, default=3, help="fresh autotuner runs per shape")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, t = "cuda", args.tokens
    tuned = gemv._rows_tuned[True]  # the shipped autotune set (KernelConfig.rows_more_configs)
    res: dict = {"env": device_info(), "command": "python " + " ".join(sys.argv), "tokens": t, "shapes": {}}
    for name, n, k, norm, residual in SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        g = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
        r = torch.randn(t, n, device=dev, dtype=torch.bfloat16)
        y = torch.empty(t, n, device=dev, dtype=torch.bfloat16)
        gb = w.numel() * w.element_size() / 1e9
        row: dict = {"N": n, "K": k, "norm": norm, "residual": residual, "GB": gb, "configs": []}

        def rate(ms):
            return round(gb / ms, 3)  # TB/s of weight streamed

        def product(rows: int):
            """The op the fast path runs for this product over `rows` tokens (1: the GEMV)."""
            xs = x[:rows].contiguous()
            if norm:
                return gemv.gemv_rms(xs, g, w, 1e-5, True)
            return gemv.gemv_add(xs, w, r[:rows].contiguous(), True) if residual else gemv.gemv(xs, w, True)

        ms = do_bench(lambda: x @ w.T)
        row["cublas_ms"], row["cublas_TBps"] = ms, rate(ms)
        ms = do_bench(lambda: product(1))
        row["gemv_one_token_ms"], row["gemv_one_token_TBps"] = ms, rate(ms)
        for c in tuned.configs:
            kw = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)

            def run():
                grid = (triton.cdiv(n, kw["BLOCK_N"]),)
                gemv._rows_kernel[grid](w, x, y, g, r, n, t, 1e-5, k, TP=16, NORM=norm, RESIDUAL=residual,
                                        UPCAST=False, **kw)
            try:
                times = [do_bench(run) for _ in range(2)]
                row["configs"].append({**kw, "ms": times, "TBps": rate(min(times))})
            except Exception as e:  # a config past the SM's shared memory
                row["configs"].append({**kw, "error": f"{type(e).__name__}"[:80]})
        ok = sorted((c for c in row["configs"] if "ms" in c), key=lambda c: min(c["ms"]))
        row["best"] = ok[0] if ok else None
        picks = []
        for _ in range(args.picks):
            tuned.cache.clear()
            product(t)
            torch.cuda.synchronize()
            b = getattr(tuned, "best_config", None)  # set by the autotuner's run (CUDA only)
            picks.append(b and dict(b.kwargs, num_warps=b.num_warps, num_stages=b.num_stages))
        row["autotune_picks"] = picks
        res["shapes"][name] = row
        top = row["best"] or {}
        print(f"{name:8s} N={n} K={k}: cuBLAS {row['cublas_TBps']} TB/s, GEMV(1) {row['gemv_one_token_TBps']}, "
              f"rows best {top.get('TBps')} {[top.get(a) for a in ('BLOCK_N', 'BLOCK_K', 'num_warps', 'num_stages')]}; "
              f"picks {[p and tuple(p.values()) for p in picks]}", flush=True)
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_rows_configs.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
