"""Ways to stream a weight for a few tokens, on Llama-3.1-8B's product shapes, timed in CUDA graphs.

A verify step reads the same weights as a one-token step, so it should cost barely more; but the
rows kernel (`engine/gemv.py`) streams weight for 8 tokens more slowly than the one-token GEMV
does, and that gap is most of what the 8-token step costs over the one-token step. To find which
way of streaming closes it, this times, for each product shape and 8 tokens, one config at a time,
each launch inside a CUDA graph (so no launch from Python in the figure) and cycling over copies of
the weight larger than L2 together (so each launch reads HBM, as in a step):

    gemv1     the shipped one-token GEMV (autotuned), the figure to match
    rows      the shipped rows kernel, each config of its autotune set
    tma       the same product with the weight and token tiles loaded by TMA (tensor descriptors
              made on the device): the copy engine fills shared memory, no address math per thread
    blocked   the weight re-laid out once as [N/BN, K/BK, BN, BK], so each program's tile is one
              contiguous run of BN*BK elements (a layout the GEMV would have to read too)
    splitk    the rows kernel with K split over 2 or 4 programs (fp32 atomics, then a cast):
              more, smaller programs, to test whether whole-K programs leave SMs idle at the tail
    cublas    `x @ w.T` at 8 rows

and prints the products' sum per step (32 layers + the head) for the best config of each variant
against the GEMV's, the part of the 8-token step the variant would change.

    python benchmarks/rows_variants.py --out benchmarks/results     # H200, ~6 GB of GPU memory
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from specdec.bench.roofline import copy_bandwidth, device_info
from specdec.engine import gemv

# (name, rows N, columns K, RMSNorm folded, residual add folded, products per step)
SHAPES = [("gate_up", 28672, 4096, True, False, 32), ("down", 4096, 14336, False, True, 32),
          ("qkv", 6144, 4096, True, False, 32), ("o", 4096, 4096, False, True, 32),
          ("lm_head", 128256, 4096, True, False, 1)]


@triton.jit
def _rows_tma_kernel(W, X, Y, G, R, N, T, eps, K: tl.constexpr, TP: tl.constexpr, NORM: tl.constexpr,
                     RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    wd = tl.make_tensor_descriptor(W, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    xd = tl.make_tensor_descriptor(X, shape=[T, K], strides=[K, 1], block_shape=[TP, BLOCK_K])
    acc = tl.zeros((BLOCK_N, TP), dtype=tl.float32)
    squares = tl.zeros((TP,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = wd.load([pid * BLOCK_N, k0])
        x = xd.load([0, k0])  # [TP, BLOCK_K]; rows past T are filled with zeros by the copy engine
        if NORM:
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            x = (xf * tl.load(G + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)[None, :]).to(x.dtype)
        acc = tl.dot(w, tl.trans(x), acc)
    if NORM:
        acc = acc * tl.rsqrt(squares / K + eps)[None, :]
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, TP)
    out = t[None, :] * N + rows[:, None]
    inside = (t[None, :] < T) & (rows[:, None] < N)
    if RESIDUAL:
        acc += tl.load(R + out, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + out, acc.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _rows_blocked_kernel(W, X, Y, G, R, N, T, eps, K: tl.constexpr, TP: tl.constexpr, NORM: tl.constexpr,
                         RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # W is [N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K]: program pid's k-th tile is contiguous.
    pid = tl.program_id(0)
    KB: tl.constexpr = K // BLOCK_K
    base = W + pid.to(tl.int64) * (KB * BLOCK_N * BLOCK_K)
    tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    t = tl.arange(0, TP)
    acc = tl.zeros((BLOCK_N, TP), dtype=tl.float32)
    squares = tl.zeros((TP,), dtype=tl.float32)
    for kb in range(KB):
        cols = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        w = tl.load(base + kb * (BLOCK_N * BLOCK_K) + tile)
        x = tl.load(X + t[None, :] * K + cols[:, None], mask=t[None, :] < T, other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=0)
            x = (xf * tl.load(G + cols).to(tl.float32)[:, None]).to(x.dtype)
        acc = tl.dot(w, x, acc)
    if NORM:
        acc = acc * tl.rsqrt(squares / K + eps)[None, :]
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    out = t[None, :] * N + rows[:, None]
    inside = (t[None, :] < T) & (rows[:, None] < N)
    if RESIDUAL:
        acc += tl.load(R + out, mask=inside, other=0.0).to(tl.float32)
    tl.store(Y + out, acc.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _rows_splitk_kernel(W, X, YF, N, T, K: tl.constexpr, TP: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    KS: tl.constexpr = K // SPLIT
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, TP)
    acc = tl.zeros((BLOCK_N, TP), dtype=tl.float32)
    for k0 in range(s * KS, (s + 1) * KS, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(W + rows[:, None] * K + cols[None, :])
        x = tl.load(X + t[None, :] * K + cols[:, None], mask=t[None, :] < T, other=0.0)
        acc = tl.dot(w, x, acc)
    inside = (t[None, :] < T) & (rows[:, None] < N)
    tl.atomic_add(YF + t[None, :] * N + rows[:, None], acc, mask=inside)


def graph_ms(launches: list, rounds: int, replays: int = 5) -> float:
    """Mean ms per launch over `rounds` passes of `launches` captured in one CUDA graph."""
    for f in launches:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for f in launches:
                f()
    g.replay()
    torch.cuda.synchronize()
    per = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) / (rounds * len(launches)))
    del g
    return statistics.median(per)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--tag", default="h200_rows_variants")
    args = ap.parse_args()
    t_start = time.time()
    torch.manual_seed(0)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    dev, T, TP = "cuda", args.tokens, 16
    res: dict = {"env": device_info(), "command": "python " + " ".join(sys.argv), "tokens": T, "shapes": {}}
    res["copy_TBps"] = round(copy_bandwidth() / 1e12, 3)
    print(f"copy {res['copy_TBps']} TB/s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = args.shapes.split(",")
    for name, n, k, norm, residual, per_step in SHAPES:
        if name not in wanted:
            continue
        if time.time() - t_start > args.budget_s:
            res["stopped"] = f"budget reached before {name}"
            break
        nbytes = n * k * 2
        copies = max(1, min(12, -(-400_000_000 // nbytes)))  # > 400 MB in all: past L2 (50 MB) every launch
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(T, k, device=dev, dtype=torch.bfloat16)
        g = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
        r = torch.randn(T, n, device=dev, dtype=torch.bfloat16)
        y = torch.empty(T, n, device=dev, dtype=torch.bfloat16)
        rounds = max(2, 48 // copies)
        xs = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * g.float() if norm else x.float()
        want = xs @ ws[0].float().T + (r.float() if residual else 0)
        row: dict = {"N": n, "K": k, "MB": nbytes / 1e6, "per_step": per_step, "copies": copies, "variants": {}}

        def rate(ms):
            return round(nbytes / ms / 1e9, 3)  # TB/s of weight streamed

        def err(got):
            return float((got.float() - want).norm() / want.norm())

        def record(variant, cfg, launches, check):
            key = variant + ("" if cfg is None else "@" + "/".join(str(v) for v in cfg))
            try:
                ms = graph_ms(launches, rounds)
                e = check()
                row["variants"][key] = {"ms": round(ms, 5), "TBps": rate(ms), "rel_err": round(e, 4)}
            except Exception as ex:  # a config past shared memory, or a TMA box the hardware refuses
                row["variants"][key] = {"error": f"{type(ex).__name__}: {ex}"[:160]}
                torch.cuda.synchronize()

        def product(w, rows):
            xs1 = x[:rows].contiguous()
            if norm:
                return gemv.gemv_rms(xs1, g, w, 1e-5, True)
            return gemv.gemv_add(xs1, w, r[:rows].contiguous(), True) if residual else gemv.gemv(xs1, w, True)

        record("gemv1", None, [lambda w=w: product(w, 1) for w in ws], lambda: 0.0)
        record("rows-autotuned", None, [lambda w=w: product(w, T) for w in ws], lambda: err(product(ws[0], T)))
        record("cublas", None, [lambda w=w: torch.matmul(x, w.T, out=y) for w in ws], lambda: 0.0)
        flags = dict(TP=TP, NORM=norm, RESIDUAL=residual)
        for c in gemv._rows_tuned[True].configs:
            bn, bk = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
            kw = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=c.num_warps, num_stages=c.num_stages)
            grid = (triton.cdiv(n, bn),)

            def run(w, kw=kw, grid=grid):
                gemv._rows_kernel[grid](w, x, y, g, r, n, T, 1e-5, k, UPCAST=False, **flags, **kw)
            record("rows", (bn, bk, c.num_warps, c.num_stages), [lambda w=w, f=run: f(w) for w in ws],
                   lambda f=run: (f(ws[0]), err(y))[1])
        for bn, bk, wp, st in [(bn, bk, wp, st) for bn in (64, 128) for bk in (64, 128, 256) for wp in (4, 8)
                               for st in (3, 4, 6)] + [(256, 64, 8, 4), (256, 128, 8, 3), (32, 256, 4, 4)]:
            if n % bn:
                continue
            grid = (n // bn,)

            def run(w, bn=bn, bk=bk, wp=wp, st=st, grid=grid):
                _rows_tma_kernel[grid](w, x, y, g, r, n, T, 1e-5, k, **flags, BLOCK_N=bn, BLOCK_K=bk,
                                       num_warps=wp, num_stages=st)
            record("tma", (bn, bk, wp, st), [lambda w=w, f=run: f(w) for w in ws], lambda f=run: (f(ws[0]), err(y))[1])
        for bn, bk in ((16, 512), (16, 1024), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128), (128, 256)):
            if n % bn or k % bk:
                continue
            blocked = [w.view(n // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous() for w in ws]
            for wp, st in ((4, 3), (4, 4), (8, 3), (8, 4)):
                grid = (n // bn,)

                def run(w, bn=bn, bk=bk, wp=wp, st=st, grid=grid):
                    _rows_blocked_kernel[grid](w, x, y, g, r, n, T, 1e-5, k, **flags, BLOCK_N=bn, BLOCK_K=bk,
                                               num_warps=wp, num_stages=st)
                record("blocked", (bn, bk, wp, st), [lambda w=w, f=run: f(w) for w in blocked],
                       lambda f=run: (f(blocked[0]), err(y))[1])
            blocked = None  # rebound, not `del`: the lambdas above capture it (F821)
        if not norm:  # the probe sums partial products; a norm would need the whole row's squares first
            yf = torch.empty(T, n, device=dev, dtype=torch.float32)
            for bn, bk, wp, st, split in ((64, 128, 4, 3, 2), (64, 128, 4, 3, 4), (128, 128, 8, 3, 2),
                                          (128, 128, 8, 3, 4), (64, 256, 4, 4, 2), (32, 256, 4, 4, 4)):
                if n % bn or (k // split) % bk:
                    continue

                def run(w, bn=bn, bk=bk, wp=wp, st=st, split=split):
                    yf.zero_()
                    _rows_splitk_kernel[(n // bn, split)](w, x, yf, n, T, k, TP=TP, BLOCK_N=bn, BLOCK_K=bk,
                                                          SPLIT=split, num_warps=wp, num_stages=st)
                    if residual:
                        torch.add(yf, r, out=y)
                    else:
                        y.copy_(yf)
                record("splitk", (bn, bk, wp, st, split), [lambda w=w, f=run: f(w) for w in ws],
                       lambda f=run: (f(ws[0]), err(y))[1])
        best = {}
        for key, v in row["variants"].items():
            fam = key.split("@")[0]
            if "ms" in v and v["rel_err"] < 0.05 and (fam not in best or v["ms"] < best[fam]["ms"]):
                best[fam] = {"config": key, **v}
        row["best"] = best
        res["shapes"][name] = row
        print(f"{name:8s} {nbytes / 1e6:7.1f} MB: " + ", ".join(f"{f} {b['TBps']} ({b['config'].split('@')[-1]})"
                                                             for f, b in best.items()), flush=True)
        (out / f"{args.tag}.json").write_text(json.dumps(res, indent=2) + "\n")
        ws = None  # rebound, not `del`: the lambdas above capture it (F821)
        torch.cuda.empty_cache()
    # The products of one step: the GEMV's sum at one token against each variant's best at T tokens
    # (shapes without a variant's figure take the shipped autotuned rows kernel's).
    done = res["shapes"]
    if done:
        def step(fam):
            return sum(s["per_step"] * (s["best"].get(fam) or s["best"]["rows-autotuned"])["ms"] for s in done.values())
        fams = ("gemv1", "rows-autotuned", "rows", "tma", "blocked", "splitk", "cublas")
        res["products_per_step_ms"] = {fam: round(step(fam), 4) for fam in fams}
        print("products per step (ms):", res["products_per_step_ms"], flush=True)
    (out / f"{args.tag}.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
