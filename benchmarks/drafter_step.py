"""Cost of one EAGLE-3 drafting round on a GPU: commit the accepted tokens, then propose a chain.

SmolLM2-135M-shaped drafter (random weights, draft vocab 16,384), bf16, one sequence whose drafter
cache grows by two positions per round as in decoding at acceptance length ~2. Variants of the
drafter's attention call:
  sdpa       F.scaled_dot_product_attention as torch picks its backend
  no-cudnn   the same call with the cuDNN backend excluded (the drafter's, small_query_attention)
  explicit   grouped-query matmul, softmax, matmul written out
then StaticChainDrafter (the same drafter, fixed shapes, two CUDA graphs per round), its steps
captured as they are and compiled by inductor first, against the eager proposer: ms per round and
whether the drafts agree. Profiles follow for sdpa and explicit.
With --e2e, also FastEngine on a random SmolLM2-shaped target (byte tokenizer): ms per step of
plain decoding and of EAGLE-3 chains (k = 5 with the eager proposer and StaticChainDrafter, k = 3
with StaticChainDrafter); random weights accept nothing, so a step is one verify of k + 1 tokens
plus one drafting round.

  python benchmarks/drafter_step.py --out benchmarks/results
  python benchmarks/drafter_step.py --static-only --e2e --rounds 100 --out $OUT
  python benchmarks/drafter_step.py --tree-only --rounds 50 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import LlamaConfig

import specdec.models.drafter as drafter_mod
from specdec.bench.roofline import card_name
from specdec.engine.api import SamplingParams
from specdec.engine.config import FastConfig, KernelConfig
from specdec.engine.eagle import Eagle3Proposer
from specdec.engine.eagle_graph import StaticChainDrafter, StaticTreeDrafter
from specdec.engine.eagle_kernels import applies
from specdec.engine.tree import TreeConfig
from specdec.models.drafter import DrafterConfig, Eagle3Drafter

SMOLLM2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192)


def rounds(prop: Eagle3Proposer, n: int, k: int, dev) -> float:
    aux = torch.randn(64, 3 * 576, device=dev, dtype=torch.bfloat16)
    prop.begin([], [0] + torch.randint(0, 49152, (64,)).tolist(), aux, 4096)
    params = SamplingParams(max_new_tokens=1 << 20, temperature=0.0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    for _ in range(n):
        prop.propose([], prop.k, params, None)
        prop.commit(aux[:2], torch.randint(0, 49152, (2,), device=dev))
    sync()
    return (time.perf_counter() - t) / n


def static_rounds(st: StaticChainDrafter, eager: Eagle3Proposer | None, n: int, dev) -> tuple[float, float]:
    """ms per round of the static drafter; with `eager`, the share of rounds whose drafts agree."""
    g = torch.Generator(device="cpu").manual_seed(1)
    aux = torch.randn(64, 3 * 576, generator=g).to(dev, torch.bfloat16)
    ids = torch.randint(0, 49152, (64,), generator=g).to(dev)
    st.start(aux, ids)
    if eager is not None:
        eager.begin([], [0] + ids.tolist(), aux, 4096)
    params = SamplingParams(max_new_tokens=1 << 20, temperature=0.0)
    agree, t_total = 0, 0.0
    for i in range(n):
        torch.cuda.synchronize() if dev.type == "cuda" else None
        t = time.perf_counter()
        d = st.propose()
        st.commit(aux[i % 60 : i % 60 + 2], ids[i % 60 : i % 60 + 2])
        torch.cuda.synchronize() if dev.type == "cuda" else None
        t_total += time.perf_counter() - t
        if eager is not None:
            agree += eager.propose([], eager.k, params, None).tokens == d.tokens
            eager.commit(aux[i % 60 : i % 60 + 2], ids[i % 60 : i % 60 + 2])
    return t_total / n * 1e3, agree / n


def tree_rounds(d: Eagle3Drafter, dev, n: int) -> dict:
    """ms per tree round (commit 2, propose a depth-6 / top-k 8 / 48-token tree), eager and static;
    the share of rounds whose trees agree."""
    tree = TreeConfig(depth=6, top_k=8, total_tokens=48)
    g = torch.Generator(device="cpu").manual_seed(1)
    aux = torch.randn(64, 3 * 576, generator=g).to(dev, torch.bfloat16)
    ids = torch.randint(0, 49152, (64,), generator=g).to(dev)
    params = SamplingParams(max_new_tokens=1 << 20, temperature=0.0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    eager = Eagle3Proposer(d, tree=tree)
    static = StaticTreeDrafter(d, tree=tree, max_len=4096, compile=dev.type == "cuda")
    t0 = time.perf_counter()
    static.warm()
    warm = time.perf_counter() - t0
    res = {"tree": vars(tree), "compile_and_capture_s": warm}
    for name in ("eager", "static"):
        for rounds_, timed in ((5, False), (n, True)):
            eager.begin([], [0] + ids.tolist(), aux, 4096)
            static.start(aux, ids)
            sync()
            t = time.perf_counter()
            for i in range(rounds_):
                if name == "eager":
                    eager.propose([], eager.k, params, None)
                    eager.commit(aux[i % 60 : i % 60 + 2], ids[i % 60 : i % 60 + 2])
                else:
                    static.propose()
                    static.commit(aux[i % 60 : i % 60 + 2], ids[i % 60 : i % 60 + 2])
            sync()
            if timed:
                res[f"{name}_ms_per_round"] = (time.perf_counter() - t) / rounds_ * 1e3
    eager.begin([], [0] + ids.tolist(), aux, 4096)
    static.start(aux, ids)
    agree = 0
    for i in range(50):
        a, b = eager.propose([], eager.k, params, None), static.propose()
        agree += (a.tokens, a.parents) == (b.tokens, b.parents)
        eager.commit(aux[i % 60 : i % 60 + 2], ids[i % 60 : i % 60 + 2])
        static.commit(aux[i % 60 : i % 60 + 2], ids[i % 60 : i % 60 + 2])
    res["trees_agree"] = agree / 50
    print(f"tree round: eager {res['eager_ms_per_round']:.2f} ms, static {res['static_ms_per_round']:.3f} ms; "
          f"trees equal in {agree / 50:.0%} of 50 rounds (compile and capture {warm:.1f} s)", flush=True)
    return res


E2E_ROWS = ("plain", "eagle3-k5-eager", "eagle3-k5-static", "eagle3-k3-static", "eagle3-k5-kernels",
            "eagle3-k3-kernels")


def real_e2e(dev, res, out, names, target_path: str, drafter_path: str, prompts: int, max_new: int) -> None:
    """The rows on a real target and trained drafter: MT-Bench first turns, greedy; tok/s, ms per
    step and mean acceptance length per row, every engine on one shared decoder, rows alternated
    over two passes so a drift of the machine shows."""
    from specdec.data.chat import prompt_ids
    from specdec.data.datasets import load_conversations
    from specdec.engine.api import SamplingParams as SP
    from specdec.engine.fast import FastEngine
    from specdec.evaluate import first_turn
    from specdec.models.formats import load_drafter
    from specdec.models.target import load_target

    target = load_target(target_path, device=dev, dtype="bf16")
    drafter = load_drafter(drafter_path, target, dtype=torch.bfloat16)
    convs = load_conversations("mt-bench", limit=prompts, seed=0)
    ids = [prompt_ids(target.tokenizer, first_turn(c.messages)) for c in convs]
    params = SP(max_new_tokens=max_new, temperature=0.0)
    cpu = dev.type != "cuda"  # a smoke run of this script on a CPU: the reference math, no kernels
    config = FastConfig(max_len=2048, require_cuda=not cpu)
    plain = FastEngine(target, config=config)
    engines = {"plain": plain}
    for name in names:
        if name == "plain":
            continue
        if name == "plain-host":  # the host builds each step's input from the argmax it read
            engines[name] = FastEngine(target, decoder=plain.fast, config=replace(config, steps_on_device=False))
            continue
        parts = name.split("-")  # eagle3-k3-kernels, eagle3-k3-kernels-host
        k, kind, host = int(parts[1][1:]), parts[2], parts[-1] == "host"
        run = replace(config, drafter_kernels=kind == "kernels" and not cpu, steps_on_device=not host)
        engines[name] = FastEngine(target, decoder=plain.fast, drafter=drafter, k=k, config=run)
    rows = {}
    for name, e in engines.items():
        t0 = time.perf_counter()
        e.warmup()
        e.generate(ids[0], SP(max_new_tokens=32, temperature=0.0))
        rows[name] = {"warmup_s": time.perf_counter() - t0, "passes": []}
    for pass_ in range(2):
        for name, e in engines.items():
            toks = steps = acc_len = 0
            sync = torch.cuda.synchronize if not cpu else (lambda: None)
            sync()
            t = time.perf_counter()
            for p in ids:
                r = e.generate(p, params)
                toks += r.new_tokens
                steps += r.num_steps
            sync()
            sec = time.perf_counter() - t
            acc_len = toks / steps
            rows[name]["passes"].append({"tokens_per_s": toks / sec, "ms_per_step": sec / steps * 1e3,
                                         "tokens_per_step": acc_len, "new_tokens": toks})
            print(f"real {name:18s} pass {pass_}: {toks / sec:8.1f} tok/s, {sec / steps * 1e3:6.3f} ms per step, "
                  f"{acc_len:.2f} tokens per step", flush=True)
            res["real_e2e"] = rows
            (out / f"{card_name()}_drafter_step_real.json").write_text(json.dumps(res, indent=1))
    if cpu:
        return
    for name, e in engines.items():
        # The GPU's busy time per step against the wall time: what the host still adds.
        try:
            rows[name]["profile"] = step_profile(e, ids[0], params, name, out)
        except Exception as err:  # a profiler that cannot see graph replays: the row goes without
            print(f"real {name}: no profile ({type(err).__name__}: {err})", flush=True)
    (out / f"{card_name()}_drafter_step_real.json").write_text(json.dumps(res, indent=1))


def step_profile(e, prompt, params, name: str, out: Path) -> dict:
    """One profiled generate: per step, the kernels launched, the time the GPU was busy (the union
    of kernel intervals) and the span from the first kernel to the last; the busiest kernels go to
    `out`/CARD_step_profile.txt. Busy < span per step is time the GPU waited (host, launches)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = e.generate(prompt, params)
        torch.cuda.synchronize()
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [ev for ev in json.loads(trace.read_text())["traceEvents"]
              if ev.get("cat") == "kernel" and "dur" in ev]
    spans = sorted((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])) for ev in events)
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    steps = r.num_steps
    row = {"kernels_per_step": len(spans) / steps, "gpu_busy_ms_per_step": busy / 1e3 / steps,
           "gpu_span_ms_per_step": (spans[-1][1] - spans[0][0]) / 1e3 / steps if spans else 0.0}
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
    with open(out / f"{card_name()}_step_profile.txt", "a") as f:
        f.write(f"== {name}: {json.dumps(row)}\n{table}\n")
    print(f"profile {name:18s} {row['kernels_per_step']:6.1f} kernels, GPU busy {row['gpu_busy_ms_per_step']:.3f} "
          f"of {row['gpu_span_ms_per_step']:.3f} ms per step", flush=True)
    return row


def e2e(dev, res, out, names=E2E_ROWS, profile_steps: bool = False) -> None:
    import tempfile

    from transformers import AutoModelForCausalLM

    from specdec.engine.api import SamplingParams as SP
    from specdec.engine.fast import FastEngine
    from specdec.engine.tree import TreeConfig
    from specdec.models.target import load_target
    from specdec.models.tiny import byte_tokenizer

    folder = Path(tempfile.mkdtemp()) / "smollm2-random"
    torch.manual_seed(0)
    cfg = SMOLLM2.__class__(**{**SMOLLM2.to_dict(), "tie_word_embeddings": True, "rope_theta": 100000.0})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    target = load_target(str(folder), device=dev, dtype="bf16")
    dcfg = DrafterConfig.for_target(target.config, draft_vocab_size=16384, aux_layer_ids=target.aux_layer_ids)
    drafter = Eagle3Drafter(dcfg).to(dev, torch.bfloat16).eval()
    prompt = list(range(3, 67))
    params = SP(max_new_tokens=128 if dev.type == "cuda" else 8, ignore_eos=True)
    config = FastConfig(max_len=512, require_cuda=False)
    plain = FastEngine(target, config=config)
    rows = {}
    tree = TreeConfig(depth=6, top_k=8, total_tokens=48)
    def chain(k):
        return {"drafter": drafter, "k": k}

    host = {"steps_on_device": False}
    eager, static, kernels = {"static_drafter": False}, {"drafter_kernels": False}, {"drafter_kernels": True}
    # name: (the engine's proposer, what its FastConfig changes)
    variants = {"plain": ({}, {}), "plain-host": ({}, host),
                "eagle3-k5-eager": (chain(5), eager), "eagle3-k5-static": (chain(5), static),
                "eagle3-k3-static": (chain(3), static), "eagle3-k5-kernels": (chain(5), kernels),
                "eagle3-k3-kernels": (chain(3), kernels), "eagle3-k1-kernels": (chain(1), kernels),
                "eagle3-k3-kernels-host": (chain(3), {**kernels, **host}),
                "eagle3-k5-kernels-host": (chain(5), {**kernels, **host}),
                "eagle3-tree-eager": ({"drafter": drafter, "tree": tree}, eager),
                "eagle3-tree-static": ({"drafter": drafter, "tree": tree}, {})}
    for name in ("plain", *[n for n in names if n != "plain"]):
        kw, changes = variants[name]
        if changes.get("drafter_kernels") and not applies(drafter, kw["k"] + 1, KernelConfig()):
            print(f"e2e {name:18s} skipped: the kernels need Triton on a GPU (or TRITON_INTERPRET=1)")
            continue
        run = replace(config, **changes)
        e = plain if name == "plain" else FastEngine(target, decoder=plain.fast, config=run, **kw)
        t0 = time.perf_counter()
        e.warmup()
        warm = time.perf_counter() - t0
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        e.generate(prompt, params)
        sync()
        t = time.perf_counter()
        r = e.generate(prompt, params)
        sync()
        sec = time.perf_counter() - t
        rows[name] = {"ms_per_step": sec / r.num_steps * 1e3, "steps": r.num_steps, "new_tokens": r.new_tokens,
                      "warmup_s": warm, "token_ids_head": r.token_ids[:8]}
        print(f"e2e {name:18s} {rows[name]['ms_per_step']:7.3f} ms per step ({r.num_steps} steps, "
              f"warm-up {warm:.1f} s)", flush=True)
        if profile_steps and dev.type == "cuda":
            rows[name]["profile"] = step_profile(e, prompt, params, name, out)
        res["e2e"] = rows
        (out / f"{card_name()}_drafter_step.json").write_text(json.dumps(res, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--e2e", action="store_true", help="also time FastEngine steps on a random SmolLM2-shaped target")
    ap.add_argument("--e2e-rows", default=",".join(E2E_ROWS),
                    help="engine rows for --e2e (plain always runs first): plain, plain-host (the host builds each "
                         "step's input from the argmax it read), eagle3-k5-eager, "
                         "eagle3-k5-static, eagle3-k3-static, eagle3-k5-kernels, eagle3-k3-kernels (the drafter's "
                         "layer on the Triton kernels), eagle3-k3-kernels-host, eagle3-k5-kernels-host (the "
                         "host reads the drafts, then the argmax), eagle3-tree-eager, eagle3-tree-static")
    ap.add_argument("--e2e-only", action="store_true", help="only the engine rows (--e2e-rows), random weights")
    ap.add_argument("--profile-steps", action="store_true",
                    help="with --e2e-only: profile each row once more (kernels per step, GPU busy against span)")
    ap.add_argument("--target", help="with --drafter: the e2e rows on this real target (MT-Bench first turns)")
    ap.add_argument("--drafter", help="a trained drafter folder for --target")
    ap.add_argument("--prompts", type=int, default=5, help="MT-Bench first turns for --target (default: 5)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--tree-only", action="store_true",
                    help="time only a tree round (depth 6, top-k 8, 48 tokens): the eager proposer against "
                         "StaticTreeDrafter, compiled and captured")
    ap.add_argument("--static-only", action="store_true",
                    help="skip the eager attention variants and the profiles: time the static drafter, "
                         "captured as it is and compiled, and (with --e2e) the engine")
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

    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "k": 5, "rounds": args.rounds}
    if args.e2e_only:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        e2e(dev, res, out, args.e2e_rows.split(","), profile_steps=args.profile_steps)
        return 0
    if args.target:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        real_e2e(dev, res, out, args.e2e_rows.split(","), args.target, args.drafter, args.prompts,
                 args.max_new_tokens)
        return 0
    if args.tree_only:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if args.rounds:
            res["tree"] = tree_rounds(d, dev, args.rounds)
            (out / f"{card_name()}_drafter_step_tree.json").write_text(json.dumps(res, indent=1))
        if args.e2e:
            e2e(dev, res, out, args.e2e_rows.split(","), profile_steps=args.profile_steps)
        return 0
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
    for name, fn in ({} if args.static_only else variants).items():
        drafter_mod.small_query_attention = fn
        prop = Eagle3Proposer(d, k=5)
        rounds(prop, 10, 5, dev)
        ms = rounds(prop, args.rounds, 5, dev) * 1e3
        res[name] = {"ms_per_round": ms}
        print(f"{name:9s} {ms:8.2f} ms per round (commit 2 + propose 5)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    drafter_mod.small_query_attention = variants["no-cudnn"]
    statics = (("static", False, False), ("static-compiled", True, False), ("static-kernels", True, True))
    statics = statics if applies(d, 6, KernelConfig()) else statics[:2]  # the kernels need Triton on a GPU
    for name, compile, kernels in statics:
        st = StaticChainDrafter(d, k=5, max_len=4096, compile=compile, kernels=kernels)
        t0 = time.perf_counter()
        st.warm()
        warm = time.perf_counter() - t0
        static_rounds(st, None, 10, dev)
        ms, _ = static_rounds(st, None, args.rounds, dev)
        _, agree = static_rounds(st, Eagle3Proposer(d, k=5), 50, dev)
        res[name] = {"ms_per_round": ms, "drafts_agree_with_eager": agree, "capture_s": warm}
        print(f"{name:15s} {ms:8.3f} ms per round; drafts equal to the eager proposer's in {agree:.0%} of 50 "
              f"rounds (compile and capture {warm:.1f} s)", flush=True)
        (out / f"{card_name()}_drafter_step.json").write_text(json.dumps(res, indent=1))
    if dev.type == "cuda":  # where a round's GPU time goes: the compiled steps without graphs, kernel by kernel
        from torch.profiler import ProfilerActivity, profile

        tables = []
        for name, compile, kernels in statics[1:]:
            st = StaticChainDrafter(d, k=5, max_len=4096, compile=compile, kernels=kernels, cuda_graphs=False)
            static_rounds(st, None, 10, dev)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                static_rounds(st, None, 20, dev)
            tables.append(f"== {name}, no graphs: 20 rounds (commit 2 + propose 5)\n"
                          + p.key_averages().table(sort_by="cuda_time_total", row_limit=25))
            print(tables[-1], flush=True)
        (out / f"{card_name()}_drafter_step_static_profile.txt").write_text("\n".join(tables))
    if args.e2e:
        try:
            e2e(dev, res, out, args.e2e_rows.split(","), profile_steps=args.profile_steps)
        except Exception as e:  # keep what was measured
            res["e2e_error"] = repr(e)
            print("e2e failed:", repr(e), flush=True)
    if args.static_only:
        return 0
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
    (out / f"{card_name()}_drafter_step.json").write_text(json.dumps(res, indent=1))
    (out / f"{card_name()}_drafter_step_profile.txt").write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
