"""Where a drafter training step's device time goes, priced op by op on any machine.

One TTT forward and backward of the GPU quickstart's SmolLM2 drafter (or the 8B shapes) runs on
this machine under a dispatch mode that sees every aten op autograd issues, as the GPU would run
them one kernel each (eager, or replayed from a CUDA graph). Each op is priced on a roofline of the
card: the larger of its bytes over the memory bandwidth, its FLOPs over the matrix rate (bf16 or
fp32 by its inputs) and a floor per kernel. The table groups the ops by name, largest first, and
the total is the predicted device time of one step, to set against the measured one
(`train_throughput.py`'s graphs row: tokens per step over tokens/s). Views cost nothing; the
optimizer's step is priced apart (fused AdamW reads and writes every parameter's four tensors).

    python benchmarks/train_step_cost.py                     # SmolLM2 drafter, 4,096 tokens
    python benchmarks/train_step_cost.py --rows 8 --length 512 --json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from specdec.bench.roofline import drafter_training_shapes, random_model
from specdec.models.drafter import DrafterConfig, Eagle3Drafter
from specdec.models.target import Target
from specdec.train.ttt import Batch, TargetHead, target_argmax, ttt_loss

# The card: HBM bandwidth a copy reaches, dense matrix rates, and the shortest kernel in a graph.
BANDWIDTH = 4.2e12
MATRIX_RATE = {torch.bfloat16: 700e12, torch.float16: 700e12, torch.float32: 50e12}
KERNEL_FLOOR_S = 2.5e-6
FREE = {"view", "_unsafe_view", "slice", "expand", "t", "transpose", "unsqueeze", "squeeze", "permute",
        "as_strided", "alias", "detach", "select", "_reshape_alias", "unbind", "split", "split_with_sizes",
        "lift_fresh", "reshape"}
GATHERS = {"embedding", "index_select", "index"}  # (table, indices...): each reads only the rows it returns


def matmul_flops(name: str, args) -> float:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name in ("mm", "addmm"):
        a, b = tensors[-2], tensors[-1]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if name in ("bmm", "baddbmm"):
        a, b = tensors[-2], tensors[-1]
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 0.0


class Pricer(TorchDispatchMode):
    def __init__(self, by_shape: bool = False):
        super().__init__()
        self.by_shape = by_shape
        self.ops = defaultdict(lambda: {"kernels": 0, "bytes": 0.0, "flops": 0.0, "seconds": 0.0})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0].rstrip("_")
        if name in FREE:
            return out
        ins, _ = tree_flatten((args, kwargs or {}))
        outs, _ = tree_flatten(out)
        # A broadcast input is read once: its storage, not its view's element count.
        read = sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
                   for t in ins if isinstance(t, torch.Tensor))
        written = sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
        if name in GATHERS:  # the rows it returns and the indices, not the whole table
            read = written + sum(t.numel() * t.element_size() for t in ins[1:] if isinstance(t, torch.Tensor))
        flops = matmul_flops(name, args)
        dtype = next((t.dtype for t in ins if isinstance(t, torch.Tensor) and t.is_floating_point()), torch.float32)
        seconds = max((read + written) / BANDWIDTH, flops / MATRIX_RATE.get(dtype, 50e12), KERNEL_FLOOR_S)
        # Kernels over a non-contiguous operand (a slice, a transpose; not a broadcast) run without
        # vectorised loads: on the card such copies took ~10x their bytes' time (log 13).
        if name != "mm" and name != "bmm" and any(isinstance(t, torch.Tensor) and t.numel() > 1 and 0 not in t.stride()
                                                  and not t.is_contiguous() for t in ins):
            name += " (strided)"
        if self.by_shape:  # the op's largest operand names the group: which tensor the bytes are
            big = max((t for t in ins + outs if isinstance(t, torch.Tensor)), key=lambda t: t.numel(), default=None)
            name += "" if big is None else f" {list(big.shape)} {str(big.dtype).removeprefix('torch.')}"
        row = self.ops[name]
        row["kernels"] += 1
        row["bytes"] += read + written
        row["flops"] += flops
        row["seconds"] += seconds
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=["smollm2", "8b"], default="smollm2")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--length", type=int, default=320, help="tokens per row (every row full)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=None, help="default: 16,384 (8b: 32,000)")
    ap.add_argument("--by-shape", action="store_true", help="group by op and its largest operand's shape")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg, aux, vocab = drafter_training_shapes(args.shapes)
    vocab = args.draft_vocab or vocab
    model = random_model(cfg, device="cpu", dtype=torch.bfloat16)
    target = Target(model, None, name=args.shapes, aux_layer_ids=aux)
    drafter = Eagle3Drafter(DrafterConfig.for_target(cfg, draft_vocab_size=vocab, aux_layer_ids=aux))
    drafter.set_vocab_mapping(torch.arange(vocab))
    head = TargetHead.from_target(target)
    B, L, H = args.rows, args.length, cfg.hidden_size
    ids = torch.randint(0, vocab, (B, L))
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[:, : L // 5] = False  # a prompt, then the answer
    last = torch.randn(B, L, H, dtype=torch.bfloat16)
    batch = Batch(ids, mask, torch.randn(B, L, 3 * H, dtype=torch.bfloat16), last, torch.ones(B, L, dtype=torch.bool),
                  target_argmax(head, last, mask.roll(-1, 1)))  # cached once per sample in training
    pricer = Pricer(args.by_shape)
    with torch.autocast("cpu", dtype=torch.bfloat16), pricer:
        out = ttt_loss(drafter, batch, head, steps=args.ttt)
    with pricer:
        out.loss.backward()
    params = [p for p in drafter.parameters() if p.requires_grad]
    adam_bytes = sum(p.numel() for p in params) * 4 * (4 + 3)  # param, grad, two moments read; three written
    ops = sorted(pricer.ops.items(), key=lambda kv: -kv[1]["seconds"])
    total = sum(r["seconds"] for _, r in ops) + adam_bytes / BANDWIDTH
    kernels = sum(r["kernels"] for _, r in ops)
    result = {"shapes": args.shapes, "rows": B, "length": L, "tokens": B * L, "ttt": args.ttt, "draft_vocab": vocab,
              "kernels": kernels, "predicted_step_ms": 1e3 * total, "optimizer_ms": 1e3 * adam_bytes / BANDWIDTH,
              "ops": [{"op": k, **{f: round(v, 6) if isinstance(v, float) else v for f, v in r.items()}}
                      for k, r in ops]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{args.shapes} drafter, {B} x {L} tokens, TTT {args.ttt}, draft vocab {vocab:,}: {kernels:,} kernels, "
          f"predicted {1e3 * total:.1f} ms per step on the card (optimizer {result['optimizer_ms']:.2f} ms)")
    width = 60 if args.by_shape else 28
    print(f"{'op':<{width}}{'kernels':>8}{'GB':>9}{'TFLOP':>8}{'ms':>8}{'share':>7}")
    for name, r in ops[: 30 if args.by_shape else 20]:
        print(f"{name:<{width}}{r['kernels']:>8}{r['bytes'] / 1e9:>9.2f}{r['flops'] / 1e12:>8.2f}"
              f"{1e3 * r['seconds']:>8.2f}{r['seconds'] / total:>7.1%}")


if __name__ == "__main__":
    main()
