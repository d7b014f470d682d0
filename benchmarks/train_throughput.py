"""Drafter training throughput of `specdec train` itself, data path and evaluations included.

A target with random bf16 weights (built on the device, no download) and a synthetic capture
written by the capture store (ShareGPT-like lengths: a 20-170 token prompt and an answer of up to
256 tokens, random hidden states), trained for a fixed number of optimizer steps with the GPU
quickstart's settings (4,096 tokens per batch, TTT 7, lr 1e-3). Shapes (--shapes):

  smollm2    SmolLM2-135M's drafter, draft vocab 16,384 (the GPU quickstart's)
  8b         a Llama-3.1-8B drafter: hidden 4,096, target vocab 128,256, draft vocab 32,000; the
             target has 4 layers, since only its width, head and embedding enter the drafter's step

Rows:

  eager      no held-out evaluation, no checkpoints, the loss run op by op (train --no-compile)
  compiled   the same with the TTT loss compiled (train --compile); the first step waits for the
             compiler, and the rate counts it
  compiled-warm  the same again in this process: the compiler's caches hold the kernels, so the rate
             is the compiled step's own (compiled's wall time less this one's is about the compile)
  graphs     each optimizer step recorded as one CUDA graph per batch shape and replayed, the loss run op
             by op inside it (train --cuda-graphs: batches padded to one shape per 64-token length bucket)
  graphs-compiled  the same with the compiled loss recorded (train --compile --cuda-graphs)
  graphs-compiled-warm  the same again in this process
  online     the graphs row trained online (train --online --cuda-graphs): the random target's forward
             on the same token ids makes each batch's states in the loop, as from regenerated
             conversations, replayed from a CUDA graph per padded shape; before it, that forward
             alone over 60 batches (the source's own rate), recorded and eager
  online-eager-forward  the same with the target's forward run eagerly (as before it was recorded)
  graphs-fused  the graphs row with each TTT step's soft cross-entropy as one Triton kernel each way
             (train --cuda-graphs --fused-loss)
  online-fused  the online row with that loss (train --online --cuda-graphs --fused-loss)
  online-compiled  the online row with the compiled loss recorded (train --online --compile
             --cuda-graphs); the rate counts the compile, as a quickstart's training would
  online-compiled-warm  the same again in this process (the difference of the two walls is the compile)
  quickstart compiled, with `specdec train`'s defaults: held-out evaluation every 100 steps, a
             checkpoint every 200

Each row reports tokens/s as `train` measures it (the summary's rate), the last step's loss (equal
seeds and data: the rows must agree), and MFU against Hopper's dense bf16 peak (989 TFLOP/s, the
H100 SXM's and the H200's), FLOPs counted as in throughput_8b.py. Then the last row measured but
quickstart under torch.profiler, per step in the steady state (a run of 2N steps less one of N, so
that the set-up, the graphs' recordings and the save cancel out; --profile-steps N): wall and
device busy time, the loop's phases (`train: load batch`, `wait for batch`, `optimizer step`,
`read figures`), the top kernels and host ops.

  python benchmarks/train_throughput.py --out $OUT
  python benchmarks/train_throughput.py --out $OUT --shapes 8b --samples 300 --steps 40 --profile-steps 0
  python benchmarks/train_throughput.py --cpu-size --samples 200 --steps 60 --rows eager
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from specdec.bench.roofline import card_name, drafter_training_shapes, random_model
from specdec.capture.store import CaptureStore, add_shard, open_or_create_manifest, write_shard
from specdec.models.target import Target
from specdec.models.tiny import tiny_config
from specdec.data.chat import Rendered
from specdec.train.data import GRAPH_LENGTH_MULTIPLE, OfflineSource, OnlineSource, global_batches, padded_shape
from specdec.train.loop import TrainConfig, train

HOPPER_BF16_PEAK = 989.4e12


def synthetic_capture(directory: Path, cfg, n: int, g: torch.Generator, aux_layer_ids: list[int]) -> CaptureStore:
    H, V = cfg.hidden_size, cfg.vocab_size
    identity = {"target_fingerprint": "random", "aux_layer_ids": aux_layer_ids, "layer_convention": "eagle",
                "last_state": "pre_norm", "hidden_size": H, "tokenizer_fingerprint": "none", "dtype": "bfloat16",
                "max_length": 2048}
    open_or_create_manifest(directory, identity)
    # Zipf-like token ids: a draft vocab built from counts then covers most tokens, as on real text.
    weights = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    per_shard = 300
    for s0 in range(0, n, per_shard):
        samples, ids = [], []
        for i in range(s0, min(n, s0 + per_shard)):
            prompt = int(torch.randint(20, 170, (1,), generator=g))
            answer = 256 if torch.rand(1, generator=g) < 0.6 else int(torch.randint(30, 256, (1,), generator=g))
            T = prompt + answer
            mask = torch.zeros(T, dtype=torch.uint8)
            mask[prompt:] = 1
            samples.append({"input_ids": torch.multinomial(weights, T, replacement=True, generator=g).int(),
                            "loss_mask": mask,
                            "aux_hidden": torch.randn(T, 3 * H, generator=g).bfloat16(),
                            "last_hidden": torch.randn(T, H, generator=g).bfloat16()})
            ids.append(f"s{i}")
        add_shard(directory, write_shard(directory / f"shard-{s0 // per_shard:05d}.safetensors", samples, ids))
    return CaptureStore(directory)


ROWS = ("eager", "compiled", "compiled-warm", "graphs", "graphs-compiled", "graphs-compiled-warm", "online",
        "online-eager-forward", "online-compiled", "online-compiled-warm", "graphs-fused", "online-fused", "quickstart")


def row_settings(row: str) -> dict:
    """TrainConfig's compile, cuda_graphs and fused_loss for a row."""
    if row not in ROWS:
        raise SystemExit(f"unknown row {row!r}: expected one of {', '.join(ROWS)}")
    online = row.startswith("online")
    compiled = "compiled" in row or row == "quickstart"
    return {"compile": compiled, "cuda_graphs": row.startswith("graphs") or online, "fused_loss": "fused" in row}


def row_config(row: str, out: Path, steps: int, sizes: dict) -> TrainConfig:
    """The TrainConfig a row trains with for `steps` steps: `sizes` (batch tokens, TTT steps, draft
    vocab) and the row's settings; held-out evaluation and checkpoints only in the quickstart row."""
    if row == "quickstart":
        evals = dict(eval_every=100, save_every=200)
    else:
        evals = dict(eval_every=10**9, save_every=10**9, eval_percent=0.0)
    return TrainConfig(out=str(out), epochs=100.0, max_steps=steps, lr=1e-3, **sizes, **row_settings(row), **evals)


class EagerForwardSource(OnlineSource):
    """The online source with the target's forward never recorded (the shape it is given ignored)."""

    def get(self, indices, shape=None):
        return super().get(indices)


def source_for(row: str, store: CaptureStore, target: Target):
    """The capture as it is (offline), or its token ids run through the target in the loop (online)."""
    if not row.startswith("online"):
        return OfflineSource(store)
    rendered = [store.sample(i, ("input_ids", "loss_mask")) for i in range(len(store))]
    rendered = [Rendered(r["input_ids"].tolist(), r["loss_mask"].tolist()) for r in rendered]
    kind = EagerForwardSource if row == "online-eager-forward" else OnlineSource
    return kind(target, rendered, list(store.sample_ids), torch.bfloat16, max_length=None)


def forward_rate(source: OnlineSource, batch_tokens: int, batches: int, profiled: bool = False,
                 recorded: bool = False) -> float:
    """Tokens/s of the online source alone: the target's forward and the states' split, batch by
    batch; `recorded`: at the padded shapes training gives it, so replayed from CUDA graphs (the
    first pass over the batches records them); `profiled`: under torch.profiler, its tables printed
    (the steady state only)."""
    from contextlib import nullcontext

    from torch.profiler import ProfilerActivity, profile

    order = global_batches(list(range(len(source.ids))), source.lengths, batch_tokens, seed=0, epoch=0,
                           multiple=GRAPH_LENGTH_MULTIPLE)[:batches]

    def get(b):
        shape = padded_shape(len(b), max(source.lengths[i] for i in b), batch_tokens, GRAPH_LENGTH_MULTIPLE)
        return source.get(b, shape if recorded else None)

    for b in order:  # kernels loaded, allocator warm, every shape recorded
        get(b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if profiled else nullcontext() as prof:
        t, tokens = time.perf_counter(), 0
        for b in order:
            tokens += sum(len(s["input_ids"]) for s in get(b))
        torch.cuda.synchronize()
        rate = tokens / (time.perf_counter() - t)
    if profiled:
        ka = prof.key_averages()
        print(f"online source ({'recorded' if recorded else 'eager'}), {len(order)} batches: {rate:,.0f} tok/s; "
              f"device busy "
              f"{sum(e.self_device_time_total for e in ka) / 1e6:.2f} s", flush=True)
        print(ka.table(sort_by="self_device_time_total", row_limit=20), flush=True)
        print(ka.table(sort_by="cpu_time_total", row_limit=30), flush=True)
    return rate


def flops_per_token(cfg, ttt: int, vocab: int, ctx: float) -> float:
    """3x (forward): fc once, the layer and lm_head once per TTT step, attention over ~ctx keys."""
    H, inter = cfg.hidden_size, cfg.intermediate_size
    hd = H // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd
    layer = 2 * H * H + 2 * (2 * H) * kv + H * H + 3 * H * inter  # q (reads 2H), k, v (2H), o, MLP
    attn = sum(4.0 * (ctx + s) * cfg.num_attention_heads * hd for s in range(ttt))
    return 3.0 * (2.0 * 3 * H * H + ttt * 2.0 * (layer + vocab * H) + attn)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1200)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--shapes", choices=["smollm2", "8b"], default="smollm2")
    ap.add_argument("--profile-steps", type=int, default=None,
                    help="N: the steady-state profile from runs of N and 2N steps (default: 30 on a GPU, none on a "
                         "CPU; 0: none)")
    ap.add_argument("--tag", default="this tree")
    ap.add_argument("--profile-forward", action="store_true", help="the online row: profile the source alone")
    ap.add_argument("--cpu-size", action="store_true",
                    help="the CPU quickstart's settings on the CPU: 256 tokens per batch, TTT 4, draft vocab 2,048")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: small shapes, few steps")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    rows = args.rows.split(",")
    for row in rows:
        row_settings(row)  # an unknown row stops the run before it starts
    dev = "cuda" if torch.cuda.is_available() and not (args.tiny or args.cpu_size) else "cpu"
    if args.tiny:
        cfg, aux, vocab = tiny_config("llama", vocab_size=512), [1, 2, 3], 128
    else:
        cfg, aux, vocab = drafter_training_shapes(args.shapes)
    model = random_model(cfg, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    target = Target(model, None, name=f"{args.shapes}-shapes", aux_layer_ids=aux)
    steps = 20 if args.tiny else args.steps
    batch_tokens, ttt = 4096, 7
    if args.cpu_size:
        vocab, batch_tokens, ttt = 2048, 256, 4
    sizes = dict(batch_tokens=batch_tokens, ttt_steps=ttt, draft_vocab_size=vocab)
    work = Path(tempfile.mkdtemp(prefix="train_tp_"))
    t = time.perf_counter()
    n = 120 if args.tiny else args.samples
    store = synthetic_capture(work / "capture", cfg, n, torch.Generator().manual_seed(0), aux)
    lengths = store.lengths()
    print(f"[{args.tag}] capture: {len(store)} samples, {sum(lengths):,} tokens ({time.perf_counter() - t:.0f} s)",
          flush=True)
    ctx = sum(m * m / 2 for m in lengths) / sum(lengths)
    fpt = flops_per_token(cfg, ttt, vocab, ctx)

    def record(result: dict) -> None:  # row by row: a run stopped at its time limit keeps what it measured
        if args.out:
            with open(Path(args.out) / f"{card_name()}_train_throughput.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")

    for row in rows:
        tc = row_config(row, work / row, steps, sizes)
        source = source_for(row, store, target)
        if row == "online" and dev == "cuda":
            for recorded in (False, True):
                rate = forward_rate(source, batch_tokens, 60, profiled=args.profile_forward, recorded=recorded)
                name = "online-forward-recorded" if recorded else "online-forward"
                record({"tag": args.tag, "row": name, "shapes": args.shapes, "card": card_name(), "tokens_per_s": rate})
                print(f"[{args.tag}] {args.shapes} the online source alone (the target's forward, "
                      f"{'recorded' if recorded else 'eager'}): {rate:,.0f} tok/s", flush=True)
        t = time.perf_counter()
        try:
            s = train(target, source, tc, target_name=target.name, progress=False)
        except Exception as e:  # a row that fails leaves the others to run; its error is the result
            error = f"{type(e).__name__}: {e}"
            print(f"[{args.tag}] {args.shapes} {row}: failed: {error}", flush=True)
            record({"tag": args.tag, "row": row, "shapes": args.shapes, "error": error})
            continue
        tok_s = s["tokens_per_s"]
        mfu = tok_s * fpt / HOPPER_BF16_PEAK if dev == "cuda" else None
        r = {"tag": args.tag, "row": row, "shapes": args.shapes, "device": dev, "card": card_name(),
             "steps": s["steps"], "tokens_per_s": tok_s, "compiled": s.get("compiled"),
             "cuda_graphs": s.get("cuda_graphs"), "fused_loss": s.get("fused_loss"),
             "cuda_graph_shapes": s.get("cuda_graph_shapes"),
             "last_loss": s.get("last_loss"),
             "wall_s": time.perf_counter() - t, "flops_per_token": fpt, "mfu": mfu}
        record(r)
        print(f"[{args.tag}] {args.shapes} {row}: {tok_s:,.0f} tok/s over {s['steps']} steps, last loss "
              f"{r['last_loss']:.4f}" + (f", MFU {mfu:.1%}" if mfu is not None else "")
              + f" ({fpt / 1e9:.2f} GFLOP per token, {r['wall_s']:.0f} s in all)", flush=True)
    profile_steps = args.profile_steps if args.profile_steps is not None else 30 if dev == "cuda" else 0
    if profile_steps:
        profile_steady_state(args.tag, args.shapes, target, store, rows, record, profile_steps, sizes, work)


def profile_steady_state(tag: str, shapes: str, target, store, rows, record, n: int, sizes: dict,
                         work: Path) -> None:
    """The last row measured (but quickstart) under torch.profiler, per step in the steady state:
    a run of 2N steps less a run of N, divided by N, so that what every run does once (the
    drafter's build, the vocab count, the graphs' recordings, the save) cancels out. Both runs
    stay in the first epoch (the target argmax computed per sample) when N is below half an epoch."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and target.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    row = ([r for r in rows if r != "quickstart"] or ["compiled"])[-1]

    def run(steps: int, out: str):
        tc = row_config(row, work / out, steps, sizes)
        source = source_for(row, store, target)
        sync()
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            s = train(target, source, tc, target_name=target.name, progress=False)
            sync()
            wall = time.perf_counter() - t
        ops = {e.key: (e.self_device_time_total, e.self_cpu_time_total, e.cpu_time_total, e.count)
               for e in prof.key_averages()}
        return wall, ops, s.get("cuda_graph_shapes")

    run(n, "warm")  # compiles where the row compiles, and warms the allocators, outside the figures
    wall1, ops1, shapes1 = run(n, "short")
    wall2, ops2, shapes2 = run(2 * n, "long")
    zero = (0.0, 0.0, 0.0, 0)
    per_step = {k: tuple((b - a) / n for a, b in zip(ops1.get(k, zero), v)) for k, v in ops2.items()}
    wall = (wall2 - wall1) / n * 1e3
    busy = sum(v[0] for v in per_step.values()) / 1e3
    phases = {k: round(v[2] / 1e3, 3) for k, v in per_step.items() if k.startswith("train: ")}
    top_device = sorted(per_step.items(), key=lambda kv: -kv[1][0])[:20]
    top_cpu = sorted(per_step.items(), key=lambda kv: -kv[1][1])[:15]
    record({"tag": tag, "row": f"{row} profile", "shapes": shapes, "card": card_name(),
            "steps": [n, 2 * n], "graph_shapes": [shapes1, shapes2], "wall_ms_per_step": wall,
            "device_busy_ms_per_step": busy, "phases_ms_per_step": phases,
            "top_device_ms_per_step": {k: round(v[0] / 1e3, 3) for k, v in top_device} if cuda else None,
            "top_host_ms_per_step": {k: round(v[1] / 1e3, 3) for k, v in top_cpu}})
    device = f", device busy {busy:.2f} ms ({busy / wall:.0%})" if cuda else ""
    print(f"[{tag}] {shapes} {row}, steady state ({2 * n} steps less {n}, per step): wall {wall:.2f} ms"
          f"{device}; graphs recorded {shapes1} and {shapes2}", flush=True)
    print("  phases (host time, the worker's loads included):", flush=True)
    for k, v in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"    {k:<28} {v:8.2f} ms", flush=True)
    if cuda:
        print("  device time by kernel:", flush=True)
        for k, v in top_device:
            print(f"    {k[:90]:<90} {v[0] / 1e3:8.3f} ms  x{v[3]:.1f}", flush=True)
    print("  host time by op:", flush=True)
    for k, v in top_cpu:
        print(f"    {k[:90]:<90} {v[1] / 1e3:8.3f} ms  x{v[3]:.1f}", flush=True)


if __name__ == "__main__":
    main()
