"""Capture and drafter-training throughput on a Llama-3.1-8B-shaped target (random bf16 weights
built on the GPU, no download): tokens/s and model FLOPs utilisation (MFU).

capture   the forward pass every capture runs (`forward_padded`: all 32 layers, aux states of
          layers 2/16/29 and the final pre-norm state, lm_head on one token per sample), then the
          same plus the asynchronous copy of the states to pinned host memory that `run_capture`
          overlaps with the next batch. Batches of B samples x T tokens.
train     one optimizer step of `specdec train` (TTT unrolled 7 steps, decay 0.8, draft vocab
          32,000, bf16 autocast over fp32 master weights, AdamW, gradient clipping) on a batch of
          B x T captured-shaped tokens, target argmax cached as training caches it after the first
          epoch.

FLOPs counted: 2 x parameters touched per token (forward) plus causal attention (4 x ctx/2 x
heads x head_dim per layer); training counts 3x its forward (forward + backward). MFU is against
the H200's dense bf16 peak (989 TFLOP/s) and, in brackets, against the matmul rate measured on
the same GPU (DESIGN.md: ~796 TFLOP/s).

  python benchmarks/throughput_8b.py --out benchmarks/results        # ~40 GB of GPU memory
  python benchmarks/throughput_8b.py --tiny                          # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from specdec.bench.roofline import device_info, llama31_8b_config, random_model, time_cuda
from specdec.capture.run import forward_padded, to_host_async
from specdec.models.drafter import DrafterConfig, Eagle3Drafter
from specdec.models.target import Target
from specdec.train.loop import DrafterTTT
from specdec.train.ttt import TargetHead, target_argmax

H200_BF16_PEAK = 989.4e12  # dense, no sparsity (NVIDIA H200 SXM datasheet)
H200_BF16_MEASURED = 796e12  # large bf16 matmul on the lent H200 (DESIGN.md)


def attention_flops(cfg, ctx: float) -> float:
    """Per token, one forward: QK^T and AV over `ctx` keys in every layer."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 4.0 * ctx * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers


def capture_bench(cfg, batch: int, seq: int, dev: str, iters: int) -> dict:
    model = random_model(cfg, device=dev, dtype=torch.bfloat16)
    target = Target(model, None, name="llama31-8b-shapes")
    layer_params = sum(p.numel() for p in target.layers.parameters())
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    rows = [{"input_ids": ids[b].numpy(), "loss_mask": torch.ones(seq, dtype=torch.uint8).numpy()}
            for b in range(batch)]
    flops_per_token = 2.0 * layer_params + attention_flops(cfg, seq / 2)  # lm_head: one token per sample
    fwd = time_cuda(lambda: forward_padded(target, rows, torch.bfloat16), iters=iters, repeats=3, warmup=1)
    out = {"batch": batch, "seq": seq, "tokens_per_batch": batch * seq, "layer_params": layer_params,
           "flops_per_token": flops_per_token, "forward_ms": fwd["ms"]}
    out["forward_tokens_per_s"] = batch * seq / (fwd["ms"] / 1e3)
    if dev == "cuda":
        stream = torch.cuda.Stream()

        def with_copy():  # as run_capture: batch n's copy overlaps batch n+1's forward
            held = []
            for _ in range(iters):
                held.append(to_host_async(forward_padded(target, rows, torch.bfloat16), stream))
                if len(held) > 1:
                    held.pop(0).wait()
            for p in held:
                p.wait()

        with_copy()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with_copy()
        torch.cuda.synchronize()
        out["with_host_copy_tokens_per_s"] = iters * batch * seq / (time.perf_counter() - t0)
    # Drop the weights before empty_cache(). Rebound, not `del`: the closures above capture `target`, and a
    # `del` of a captured name reads as undefined to the linter (F821). The memory is released just the same.
    target = model = None
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def train_bench(cfg, batch: int, seq: int, dev: str, iters: int, draft_vocab: int, steps: int) -> dict:
    dcfg = DrafterConfig.for_target(cfg, draft_vocab_size=draft_vocab, aux_layer_ids=[2, cfg.num_hidden_layers // 2,
                                                                                        cfg.num_hidden_layers - 3])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(dcfg)
    drafter.set_vocab_mapping(torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values)
    drafter = drafter.to(dev)
    drafter.embed_tokens.weight.requires_grad_(False)  # the target's, frozen as in training
    H = cfg.hidden_size
    head = TargetHead(torch.ones(H, device=dev), 1e-5, torch.randn(cfg.vocab_size, H, device=dev) * 0.02)
    module = DrafterTTT(drafter, head, steps, 0.8)
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev, generator=g)
    mask = torch.ones(batch, seq, dtype=torch.bool, device=dev)
    aux = torch.randn(batch, seq, 3 * H, device=dev, dtype=torch.bfloat16, generator=g)
    last = torch.randn(batch, seq, H, device=dev, dtype=torch.bfloat16, generator=g)
    top = target_argmax(head, last, mask.roll(-1, 1))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=dev == "cuda")
    bf16 = dev == "cuda"

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            loss, *_ = module(ids, mask, aux, last, mask, top)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()

    t = time_cuda(step, iters=iters, repeats=3, warmup=2)
    layer = drafter.midlayer
    per_step_params = sum(p.numel() for p in layer.parameters()) + drafter.lm_head.weight.numel()
    fc = drafter.fc.weight.numel()
    head_dim = dcfg.head_dim
    attn = sum(4.0 * (seq / 2 + s) * dcfg.num_attention_heads * head_dim for s in range(steps))
    fwd = 2.0 * fc + steps * 2.0 * per_step_params + attn
    return {"batch": batch, "seq": seq, "tokens_per_batch": batch * seq, "ttt_steps": steps,
            "draft_vocab": draft_vocab, "trainable_params": sum(p.numel() for p in params),
            "flops_per_token": 3.0 * fwd, "step_ms": t["ms"],
            "tokens_per_s": batch * seq / (t["ms"] / 1e3)}


def mfu(tokens_per_s: float, flops_per_token: float) -> dict:
    achieved = tokens_per_s * flops_per_token
    return {"tflops": achieved / 1e12, "mfu": achieved / H200_BF16_PEAK,
            "of_measured_matmul_peak": achieved / H200_BF16_MEASURED}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--capture-shapes", default="4x2048,8x2048,16x2048", help="BxT batches for capture")
    ap.add_argument("--train-shapes", default="4x2048,8x2048", help="BxT batches for a training step")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on tiny shapes")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    cfg = llama31_8b_config()
    if args.tiny:
        cfg.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=512))
        args.capture_shapes, args.train_shapes, args.iters = "2x32", "2x32", 2
    result = {"env": device_info(), "target": "Llama-3.1-8B shapes, random bf16 weights", "capture": [], "train": []}

    def shapes(s):
        return [tuple(int(x) for x in p.split("x")) for p in s.split(",") if p]

    for b, t in shapes(args.capture_shapes):
        try:
            r = capture_bench(cfg, b, t, dev, args.iters)
            r.update({f"forward_{k}": v for k, v in mfu(r["forward_tokens_per_s"], r["flops_per_token"]).items()})
            if "with_host_copy_tokens_per_s" in r:
                r.update({f"with_host_copy_{k}": v
                          for k, v in mfu(r["with_host_copy_tokens_per_s"], r["flops_per_token"]).items()})
            print(f"capture {b}x{t}: forward {r['forward_tokens_per_s']:,.0f} tok/s, MFU {r['forward_mfu']:.1%}"
                  + (f"; with host copy {r['with_host_copy_tokens_per_s']:,.0f} tok/s, "
                     f"MFU {r['with_host_copy_mfu']:.1%}"
                     if "with_host_copy_mfu" in r else ""), flush=True)
        except Exception as e:  # out of memory at the largest batch: keep the others
            r = {"batch": b, "seq": t, "error": f"{type(e).__name__}: {e}"[:300]}
            print(f"capture {b}x{t}: {r['error']}", flush=True)
            if dev == "cuda":
                torch.cuda.empty_cache()
        result["capture"].append(r)
    for b, t in shapes(args.train_shapes):
        try:
            r = train_bench(cfg, b, t, dev, args.iters, 32000 if not args.tiny else 128, 7)
            r.update(mfu(r["tokens_per_s"], r["flops_per_token"]))
            print(f"train {b}x{t}: {r['tokens_per_s']:,.0f} tok/s, {r['step_ms']:.0f} ms/step, MFU {r['mfu']:.1%}",
                  flush=True)
        except Exception as e:
            r = {"batch": b, "seq": t, "error": f"{type(e).__name__}: {e}"[:300]}
            print(f"train {b}x{t}: {r['error']}", flush=True)
            if dev == "cuda":
                torch.cuda.empty_cache()
        result["train"].append(r)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = "throughput_8b_tiny.json" if args.tiny else "h200_throughput_8b.json"
    (Path(args.out) / name).write_text(json.dumps(result, indent=1))
    print(f"wrote {Path(args.out) / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
