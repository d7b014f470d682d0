"""`specdec train`: train an EAGLE-3 drafter with training-time test."""

from __future__ import annotations

import argparse

from ..errors import SpecdecError

DESCRIPTION = """\
Train an EAGLE-3 drafter on a capture directory (offline) or straight from regenerated
conversations (--online: the target runs inside the loop, nothing goes to disk). Training-time
test unrolls --ttt-steps drafting steps with loss weights decay**step. The draft vocabulary is the
--draft-vocab-size most frequent assistant tokens (d2t/t2d); --init fine-tunes an existing
drafter and keeps its vocab mapping unless --rebuild-vocab. Every --eval-every steps it prints the
per-position accuracy and a simulated acceptance length on a held-out split (also to
TensorBoard under OUT/tensorboard). Checkpoints go to OUT/checkpoints; --resume continues exactly,
also after kill -9 or with another number of processes. The result is OUT/drafter (eagle3 format).

examples:
  specdec train --target tiny-llama --data /tmp/cap -o /tmp/run --epochs 2 --draft-vocab-size 200
  specdec train --target smollm2-135m-instruct --data runs/smol/capture -o runs/smol/train
  specdec train --target smollm2-135m-instruct --online --data runs/smol/regen.jsonl -o runs/smol/train
  specdec train ... --compile                         # a long run on a GPU: the TTT step compiled once
  specdec train ... --compile --cuda-graphs           # compiled, each step replayed as a CUDA graph
  specdec train ... --cuda-graphs --fused-loss        # eager steps, the loss as one Triton kernel each way
  specdec train ... --resume                          # after a crash or kill -9
  specdec train ... --init yuhuili-style-drafter/     # fine-tune, vocab mapping kept
  torchrun --nproc-per-node 2 -m specdec train --target T --data CAP -o OUT   # DDP (gloo on CPU)
"""


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train an EAGLE-3 drafter (TTT, resumable, DDP)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, metavar="T", help="registry name, HF folder or .gguf")
    p.add_argument("--data", required=True, metavar="PATH",
                   help="capture directory, or with --online a regenerate JSONL / prompt source")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="run directory")
    p.add_argument("--online", action="store_true", help="compute hidden states on the fly (no disk)")
    p.add_argument("--epochs", type=float, default=10.0)
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default: 1e-3)")
    p.add_argument("--warmup", type=float, default=0.05, help="warmup fraction of all steps (default: 0.05)")
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (default: 0)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per optimizer step (default: 8192)")
    p.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll (default: 7)")
    p.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight decay per step (default: 0.8)")
    p.add_argument("--feature-loss", type=float, default=0.0, metavar="W",
                   help="also regress the drafter's normed output onto the target's final state, weight W "
                        "(EAGLE-1's feature loss; helps small datasets; default: 0, EAGLE-3's CE only)")
    p.add_argument("--draft-vocab-size", type=int, default=32000)
    p.add_argument("--init-layer", default="auto", metavar="auto|none|N",
                   help="start a new drafter's layer as a target decoder layer: auto = the one that reads "
                        "the top aux state (random where the shapes differ), none = random, N = layer N "
                        "(default: auto; --init keeps its drafter's weights)")
    p.add_argument("--init", metavar="DIR", help="start from this drafter (its vocab mapping is kept)")
    p.add_argument("--rebuild-vocab", action="store_true", help="with --init: rebuild d2t from this data")
    p.add_argument("--norm-before-residual", action="store_true", help="residual = normed fc output (vLLM flag)")
    p.add_argument("--intermediate-size", type=int, metavar="N",
                   help="drafter MLP width (default: the target's); narrower trains and drafts faster, and "
                        "vLLM/SGLang read it from the exported config")
    p.add_argument("--eval-percent", type=float, default=5.0, help="held-out share of samples (default: 5)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=2048, help="--online: truncate samples (default: 2048)")
    p.add_argument("--limit", type=int, help="--online: only the first N conversations")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available; torchrun: cuda:LOCAL_RANK)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="matrix products (weights and AdamW stay fp32); auto: bf16 on a GPU and on CPUs "
                        "with native bf16 (AVX512-BF16/AMX), else fp32 (default: auto)")
    p.add_argument("--compile", action="store_true",
                   help="compile the TTT step (one graph for every step and batch shape): faster steps on a "
                        "GPU after a first step that waits minutes for the compiler; for long runs")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="on one GPU, record each optimizer step (forward, backward, AdamW) as a CUDA graph and "
                        "replay it: batches are padded to one shape per length bucket (--length-multiple, 64 "
                        "unless given), one graph per shape; with --compile or without. With --online the "
                        "target's forward is recorded per shape as well")
    p.add_argument("--fused-loss", action="store_true",
                   help="on CUDA, each TTT step's soft cross-entropy as one Triton kernel forward and one "
                        "backward, reading the logits once each way (eager steps; --compile fuses its own)")
    p.add_argument("--length-multiple", type=int, default=1,
                   help="pad each batch's length to a multiple of this and its rows to what --batch-tokens holds "
                        "at that length: one batch shape per length bucket (default: 1, each batch its own shape)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    p.set_defaults(func=run)


def load_source(args, target):
    """The sample source for `args`: a capture directory, or conversations captured online."""
    from ..capture.store import CaptureStore
    from ..train.data import OfflineSource, online_source

    if not args.online:
        store = CaptureStore(args.data)
        bad = store.mismatch_with(target)
        if bad:
            raise SpecdecError(f"capture {args.data} was made with another target setup ({'; '.join(bad)}); "
                               f"capture again with this target or pass the right --target")
        return OfflineSource(store)
    from ..capture.run import load_records

    try:
        return online_source(target, load_records(args.data)[: args.limit], args.max_length)
    except SpecdecError as e:
        raise SpecdecError(f"{args.data}: {e}") from None


def parse_init_layer(value: str) -> str | int:
    if value in ("auto", "none"):
        return value
    try:
        return int(value)
    except ValueError:
        raise SpecdecError(f"--init-layer: expected auto, none or a layer index, got {value!r}") from None


def run(args) -> int:
    import json
    import os
    import time

    from ..models.target import load_target
    from ..train.loop import TrainConfig, train

    device = args.device
    if device is None and "LOCAL_RANK" in os.environ:
        import torch

        device = f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    target = load_target(args.target, device=device)
    loaded = time.perf_counter()
    source = load_source(args, target)
    timings = {"load_target_s": round(loaded - started, 1), "read_data_s": round(time.perf_counter() - loaded, 1)}
    cfg = TrainConfig(out=args.output, epochs=args.epochs, lr=args.lr, warmup=args.warmup, grad_clip=args.grad_clip,
                      weight_decay=args.weight_decay,
                      batch_tokens=args.batch_tokens, ttt_steps=args.ttt_steps, ttt_decay=args.ttt_decay,
                      feature_loss=args.feature_loss, draft_vocab_size=args.draft_vocab_size,
                      eval_percent=args.eval_percent,
                      eval_every=args.eval_every, save_every=args.save_every, seed=args.seed,
                      max_steps=args.max_steps, rebuild_vocab=args.rebuild_vocab,
                      norm_before_residual=args.norm_before_residual, intermediate_size=args.intermediate_size,
                      init_layer=parse_init_layer(args.init_layer),
                      bf16=None if args.dtype == "auto" else args.dtype == "bf16", compile=args.compile,
                      cuda_graphs=args.cuda_graphs, fused_loss=args.fused_loss,
                      length_multiple=args.length_multiple)
    summary = train(target, source, cfg, init=args.init, resume=args.resume, target_name=str(args.target),
                    timings=timings)
    if int(os.environ.get("RANK", 0)) == 0:
        if args.json:
            print(json.dumps(summary))
        else:
            print(f"drafter: {os.path.join(args.output, 'drafter')}")
    return 0
