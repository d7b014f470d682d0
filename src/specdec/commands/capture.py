"""`specdec capture`: run the target over regenerated conversations and store what training reads."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Runs the target over each conversation (rendered with its chat template) and stores, per sample,
input_ids, the assistant loss mask, the three EAGLE-3 aux hidden states [T, 3H] and the final
pre-norm state [T, H] (with the target's norm + lm_head it gives the target distribution; full
logits are never stored). Shards are safetensors written atomically; manifest.json is written
last after each shard. Before starting it prints bytes per token and the projected size, and
refuses when the disk cannot hold it.

Rerunning the same command resumes (samples in complete shards are skipped; a half-written shard
is redone). A capture made with another target, layer ids, tokenizer, --dtype or --max-length is
never appended to. Under torchrun each rank captures records i % WORLD_SIZE == RANK on its own
GPU. `specdec train` reads the directory (specdec.capture.store.CaptureStore).

examples:
  specdec capture --target tiny-llama --data /tmp/regen.jsonl -o /tmp/cap --max-length 512
  specdec capture --target smollm2-135m-instruct --data runs/smol/regen.jsonl -o runs/smol/capture
  specdec capture --target /models/big --device-map auto --data regen.jsonl -o /nvme/capture --batch-size 2
  torchrun --nproc-per-node 8 -m specdec capture --target /models/llama-8b --data regen.jsonl -o /nvme/cap
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "capture",
        help="store the target's aux hidden states for training (sharded, resumable)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, metavar="T", help="registry name, HF folder or .gguf")
    p.add_argument("--data", required=True, metavar="REGEN.jsonl",
                   help="output of `specdec regenerate` (or any prompt source with assistant turns)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="capture directory (resumed)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="storage dtype of the hidden states (default: bf16)")
    p.add_argument("--shard-tokens", type=int, default=1_000_000, metavar="N",
                   help="tokens per shard; a kill loses at most one shard (default: 1_000_000)")
    p.add_argument("--max-length", type=int, default=2048, metavar="T",
                   help="truncate samples to T tokens (default: 2048)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="samples per forward pass (default: 8)")
    p.add_argument("--batch-tokens", type=int, default=None, metavar="N",
                   help="also cap padded tokens per forward pass (default: no cap)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N records")
    p.add_argument("--device", default=None,
                   help="cuda, cuda:1, cpu (default: cuda if available; torchrun: cuda:LOCAL_RANK)")
    p.add_argument("--model-dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="dtype the target runs in (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device-map", default=None, metavar="MAP", help="e.g. auto, to spread a large target over GPUs")
    p.add_argument("--aux-layer-ids", default=None, metavar="IDS",
                   help="comma-separated aux layer ids (default: EAGLE-3's [2, L//2, L-3])")
    p.add_argument("--layer-convention", default="eagle", metavar="NAME",
                   help="convention of --aux-layer-ids: eagle/vllm/speculators (HF hidden_states index), "
                        "specforge/modelopt (layer output), sglang (default: eagle)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.capture.run import load_records, run_capture
    from specdec.dist import dist_env
    from specdec.capture.store import human_bytes
    from specdec.errors import SpecdecError
    from specdec.models.target import load_target

    for flag in ("shard_tokens", "max_length", "batch_size"):
        if getattr(args, flag) < 1:
            raise SpecdecError(f"--{flag.replace('_', '-')} must be >= 1, found {getattr(args, flag)}")
    rank, world, local_rank = dist_env()
    device, device_map = args.device, args.device_map
    if world > 1:
        import torch

        if device_map:
            raise SpecdecError("--device-map spreads one target over GPUs; under torchrun each rank holds a "
                               "whole copy on its own GPU: drop --device-map or run without torchrun")
        if device is None and torch.cuda.is_available():
            device = f"cuda:{local_rank}"
    ids = None
    if args.aux_layer_ids:
        from ..conventions import require_layer_order

        try:
            ids = require_layer_order([int(x) for x in args.aux_layer_ids.split(",")], "--aux-layer-ids")
        except ValueError:
            raise SpecdecError(f"--aux-layer-ids expects comma-separated integers like 2,15,27, "
                               f"got {args.aux_layer_ids!r}") from None
    records = load_records(args.data)
    if args.limit is not None:
        records = records[: args.limit]
    target = load_target(args.target, device=device, dtype=args.model_dtype, device_map=device_map,
                         aux_layer_ids=ids, layer_convention=args.layer_convention)
    s = run_capture(
        target, records, args.output, dtype=args.dtype, shard_tokens=args.shard_tokens,
        max_length=args.max_length, batch_size=args.batch_size, batch_tokens=args.batch_tokens,
        rank=rank, world_size=world, progress=not args.no_progress,
    )
    who = f"rank {rank}/{world}: " if world > 1 else ""
    print(f"{who}captured {s.samples:,} samples, {s.tokens:,} tokens ({s.loss_tokens:,} with loss) into "
          f"{s.shards} shard(s), {human_bytes(s.bytes)}, in {s.seconds:.1f} s: {s.tokens_per_s:,.0f} tok/s "
          f"({s.skipped_done:,} already captured)")
    if rank == 0:
        print(f"next: specdec train --data {args.output} --target {args.target} -o DRAFTER_DIR")
    return 0
