"""What verifying T tokens costs on this CPU, against one token: the target's forward with a KV
cache at T = 1, 2, 3, 4, 6 in fp32 as `load_target` loads it (few-row products routed through
`weight @ x.T`, specdec.models.cpu_products), in fp32 with plain `F.linear`, and in bf16; and the
one matrix product that explains the difference.

    python benchmarks/cpu_verify_cost.py [--target qwen2.5-coder-1.5b-instruct]

Writes benchmarks/results/cpu_verify_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from specdec.bench.roofline import device_info, time_cuda
from specdec.models.cpu_products import unroute_few_row_products
from specdec.models.target import load_target


TOKENS = (1, 2, 3, 4, 6)


def forward_ms(model, T: int, reps: int = 5) -> float:
    """Median of `reps` forwards of T tokens after a fresh 64-token prefill (not timed)."""
    prompt = torch.randint(0, 1000, (1, 64))
    times = []
    for _ in range(reps):
        cache = DynamicCache()
        model(prompt, past_key_values=cache, use_cache=True)
        x = torch.randint(0, 1000, (1, T))
        start = time.perf_counter()
        model(x, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 2)


def linear_ms(rows: int, out_features: int, in_features: int, dtype) -> dict:
    w = torch.randn(out_features, in_features, dtype=dtype)
    x = torch.randn(rows, in_features, dtype=dtype)
    return {name: round(time_cuda(fn, iters=5, repeats=5)["ms"], 2)
            for name, fn in (("F.linear", lambda: F.linear(x, w)), ("weight @ x.T", lambda: (w @ x.T).T))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    args = ap.parse_args()
    out = {"target": args.target, "env": device_info(), "forward_ms": {}, "linear_8960x1536_ms": {}}
    with torch.no_grad():
        for dtype in ("fp32", "bf16"):
            model = load_target(args.target, device="cpu", dtype=dtype).model
            if dtype == "fp32":  # load_target routes few-row products (specdec.models.cpu_products)
                out["forward_ms"]["fp32, routed (load_target's default)"] = {T: forward_ms(model, T) for T in TOKENS}
                print("fp32 routed", out["forward_ms"]["fp32, routed (load_target's default)"], flush=True)
                unroute_few_row_products(model)  # back to F.linear
            out["forward_ms"][dtype] = {T: forward_ms(model, T) for T in TOKENS}
            print(dtype, out["forward_ms"][dtype], flush=True)
            del model
            torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
            out["linear_8960x1536_ms"][dtype] = {m: linear_ms(m, 8960, 1536, torch_dtype) for m in TOKENS}
            print(dtype, out["linear_8960x1536_ms"][dtype], flush=True)
    path = Path(__file__).resolve().parent / "results" / "cpu_verify_cost.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
