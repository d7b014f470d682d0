"""Cost of one EAGLE-3 drafting round on a GPU: commit the accepted tokens, then propose a chain.

SmolLM2-135M-shaped drafter (random weights, draft vocab 16,384), bf16, one sequence whose drafter
cache grows by two positions per round as in decoding at acceptance length ~2. Variants of the
drafter's attention call:
  sdpa       F.scaled_dot_product_attention as torch picks its backend
  no-cudnn   the same call with the cuDNN backend excluded (the drafter's, small_query_attention)
  explicit   grouped-query matmul, softmax, matmul written out
Profiles follow for sdpa and explicit.

  python benchmarks/drafter_step.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from transformers import LlamaConfig  # noqa: E402

import specdec.models.drafter as drafter_mod  # noqa: E402
from specdec.engine.api import SamplingParams  # noqa: E402
from specdec.engine.eagle import Eagle3Proposer  # noqa: E402
from specdec.models.drafter import DrafterConfig, Eagle3Drafter  # noqa: E402

SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192)


def rounds(prop: Eagle3Proposer, n: int, k: int, dev) -> float:
    prop.reset(4096)
    aux = torch.randn(1, 64, 3 * 576, device=dev, dtype=torch.bfloat16)
    prop.commit(aux, torch.randint(0, 49152, (64,), device=dev))
    params = SamplingParams(max_new_tokens=1 << 20, temperature=0.0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(n):
        prop.propose(params, None, 49152)
        prop.commit(aux[:, :2], torch.randint(0, 49152, (2,), device=dev))
    sync()
    return (time.perf_counter() - t) / n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = DrafterConfig.for_target(SMOLLM2, draft_vocab_size=16384, aux_layer_ids=[2, 15, 27])
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg).to(dev, torch.bfloat16).eval()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def no_cudnn(*a, **kw):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return sdpa(*a, **kw)

    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "k": 5, "rounds": args.rounds}
    def via(fn):
        return lambda q, k, v, mask: fn(q, k, v, attn_mask=mask, enable_gqa=True)

    def explicit(q, k, v, mask):
        b, nh, t, hd = q.shape
        kvh, s = k.shape[1], k.shape[2]
        g = nh // kvh
        scores = (q.reshape(b, kvh, g * t, hd) @ k.transpose(-1, -2)).view(b, kvh, g, t, s).float() * hd**-0.5
        p = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype).view(b, kvh, g * t, s)
        return (p @ v).view(b, nh, t, hd)

    variants = {"explicit": explicit, "sdpa": via(sdpa), "no-cudnn": drafter_mod.small_query_attention}
    for name, fn in variants.items():
        drafter_mod.small_query_attention = fn
        prop = Eagle3Proposer(d, k=5)
        rounds(prop, 10, 5, dev)
        ms = rounds(prop, args.rounds, 5, dev) * 1e3
        res[name] = {"ms_per_round": ms}
        print(f"{name:9s} {ms:8.2f} ms per round (commit 2 + propose 5)", flush=True)
    from torch.profiler import ProfilerActivity, profile

    tables = []
    for name in ("sdpa", "explicit"):
        drafter_mod.small_query_attention = variants[name]
        prop = Eagle3Proposer(d, k=5)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as p:
            rounds(prop, 20, 5, dev)
        tables.append(f"== {name}: 20 rounds\n" + p.key_averages().table(sort_by="cpu_time_total", row_limit=15))
        print(tables[-1])
    table = "\n".join(tables)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_drafter_step.json").write_text(json.dumps(res, indent=1))
    (out / "h200_drafter_step_profile.txt").write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
