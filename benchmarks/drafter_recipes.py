"""Which training recipe buys the most acceptance for a CPU-sized budget?

Regenerates the quickstart's CPU data (ShareGPT prompts of <= 600 characters answered by the
target, 128 new tokens, greedy) and trains one drafter per recipe on it, each measured twice:
the held-out simulated acceptance length from training and the acceptance length the engine
measures on MT-Bench (k=5, greedy). The GPU runs every recipe in seconds, so the quickstart's
CPU defaults can be chosen from measurements rather than guesses; each row also carries the
training cost in drafter token-steps (tokens x epochs x TTT steps), the figure that sets CPU time.

    python benchmarks/drafter_recipes.py --out benchmarks/results            # GPU, ~6 min
    python benchmarks/drafter_recipes.py --recipes base,lr3e-3 --eval-prompts 5
    python benchmarks/drafter_recipes.py --prompts 320 --recipes cpu,cpu-alltok,cpu-d3-ep2 --eval-prompts 20

The `cpu*` recipes ask where the quickstart's CPU minutes go best at its own settings (320
prompts, 6 epochs, 256-token batches, lr 3e-3, TTT 4): into epochs, into more regenerated
answers, into ShareGPT's original answers (captured, not regenerated: capture runs ~3x faster per
token than generation), or into loss on the prompt tokens as well ("alltok": the target's
distribution is known at every captured position, not only on its own answers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec.capture.run import load_records, run_capture
from specdec.capture.store import CaptureStore
from specdec.data.datasets import load_conversations, short_first_turns
from specdec.data.regenerate import RegenConfig, regenerate_local
from specdec.engine.choice import make_engine
from specdec.evaluate import evaluate
from specdec.models.formats import load_drafter
from specdec.models.target import load_target
from specdec.train.data import OfflineSource, is_heldout
from specdec.train.loop import TrainConfig, train

BASE = dict(epochs=4.0, lr=1e-3, batch_tokens=1024, ttt_steps=4, draft_vocab_size=2048, init_layer="none")
RECIPES = {
    "base": ("d1", {}),
    "lr3e-3": ("d1", dict(lr=3e-3)),
    "lr3e-3-bt256": ("d1", dict(lr=3e-3, batch_tokens=256)),
    "lr6e-3-bt256": ("d1", dict(lr=6e-3, batch_tokens=256)),
    "lr3e-3-bt256-ttt3": ("d1", dict(lr=3e-3, batch_tokens=256, ttt_steps=3)),
    "lr3e-3-bt256-ep12": ("d1", dict(lr=3e-3, batch_tokens=256, epochs=12.0)),
    "x3data-lr3e-3-bt256": ("d3", dict(lr=3e-3, batch_tokens=256)),
    "orig-lr3e-3-bt256": ("d1orig", dict(lr=3e-3, batch_tokens=256, epochs=2.0)),
}
CPU = dict(lr=3e-3, batch_tokens=256, epochs=6.0, ttt_steps=4)  # the quickstart's CPU defaults (layer: BASE's)
RECIPES.update({
    "cpu": ("d1", CPU),
    "cpu-alltok": ("d1", dict(CPU, alltok=True)),
    "cpu-d3-ep2": ("d3", dict(CPU, epochs=2.0)),
    "cpu-d3": ("d3", CPU),
    "cpu-orig-ep2": ("d1orig", dict(CPU, epochs=2.0)),
    "cpu-orig-alltok-ep2": ("d1orig", dict(CPU, epochs=2.0, alltok=True)),
    "cpu-ep12": ("d1", dict(CPU, epochs=12.0)),
    # The drafter's layer started as a target decoder layer (train --init-layer): -3 reads exactly
    # the top aux state (the input of layer L-3), -1 is the last layer.
    "cpu-init-3": ("d1", dict(CPU, init_layer=-3)),
    "cpu-init-1": ("d1", dict(CPU, init_layer=-1)),
    "cpu-init-3-copy": ("d1", dict(CPU, init_layer=-3, init_embed_half="copy")),
})


class EveryToken(OfflineSource):
    """Training samples scored on every position (prompt tokens too); held-out ones as captured."""

    def __init__(self, store, eval_percent: float):
        super().__init__(store)
        self.held = {i for i, sid in enumerate(self.ids) if is_heldout(sid, eval_percent)}

    def get(self, indices, shape=None):
        samples = super().get(indices, shape)
        for i, s in zip(indices, samples):
            if i not in self.held:
                s["loss_mask"] = torch.ones_like(torch.as_tensor(s["loss_mask"])).bool()
        return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--work", default="/tmp/recipes")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--prompts", type=int, default=192)
    ap.add_argument("--originals", type=int, default=800, help="ShareGPT conversations kept with their own answers")
    ap.add_argument("--eval-prompts", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=540)
    args = ap.parse_args()
    t_start = time.perf_counter()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    target = load_target(args.target, dtype="fp32")  # the CPU's numerics

    needed = {RECIPES[name][0] for name in args.recipes.split(",")}
    short = short_first_turns("sharegpt", 600, pool=20 * args.prompts)
    n_regen = 3 * args.prompts if "d3" in needed else args.prompts
    t = time.perf_counter()
    regenerate_local(target, short[:n_regen], work / "regen3.jsonl",
                     RegenConfig(max_new_tokens=128, single_turn=True), batch_size=n_regen, progress=False)
    print(f"regenerate {n_regen}: {time.perf_counter() - t:.1f}s", flush=True)
    regen = load_records(str(work / "regen3.jsonl"))
    first = {c.id for c in short[: args.prompts]}
    d1 = [r for r in regen if r["id"] in first]
    used = {c.id for c in short[: 3 * args.prompts]}
    orig = [{"id": f"orig-{c.id}", "messages": c.messages} for c in short[3 * args.prompts:] if c.id not in used]
    sets = {"d1": d1, "d3": regen, "d1orig": d1 + orig[: args.originals]}
    stores = {}
    for name, recs in sets.items():
        if name not in needed:
            continue
        t = time.perf_counter()
        run_capture(target, recs, work / f"cap-{name}", max_length=384, progress=False, log=lambda m: None)
        stores[name] = CaptureStore(work / f"cap-{name}")
        print(f"capture {name}: {len(recs)} samples, {sum(stores[name].lengths())} tokens, "
              f"{time.perf_counter() - t:.1f}s", flush=True)

    questions = load_conversations("mt-bench", limit=args.eval_prompts, seed=0)
    rows = []
    for name in args.recipes.split(","):
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget spent: skipping {name}", flush=True)
            continue
        data, over = RECIPES[name]
        over = dict(over)
        alltok = over.pop("alltok", False)
        cfg = TrainConfig(out=str(work / f"run-{name}"), eval_every=10**9, save_every=10**9, **{**BASE, **over})
        src = EveryToken(stores[data], cfg.eval_percent) if alltok else OfflineSource(stores[data])
        t = time.perf_counter()
        summary = train(target, src, cfg, target_name=args.target, progress=False)
        t_train = time.perf_counter() - t
        drafter = load_drafter(work / f"run-{name}" / "drafter", target, dtype=target.dtype)
        try:
            engine = make_engine(target, drafter=drafter, k=5)
            res = evaluate(engine, target.tokenizer, questions, max_new_tokens=96, progress=False)
        except Exception as e:  # acceptance does not depend on the engine: fall back, say so
            print(f"fast engine failed ({type(e).__name__}: {e}); reference engine instead", flush=True)
            engine = make_engine(target, drafter=drafter, k=5, fast=False)
            res = evaluate(engine, target.tokenizer, questions, max_new_tokens=96, progress=False)
        tokens = sum(src.lengths)
        row = {
            "recipe": name, "data": data, **{**BASE, **over}, "alltok": alltok, "train_tokens": tokens,
            "token_steps": int(tokens * cfg.epochs * cfg.ttt_steps),
            "simulated_al": summary["eval"].get("simulated_acceptance_length"),
            "simulated_al_k5": summary["eval"].get("simulated_acceptance_length_k5"),
            "measured_al_k5": res["mean_acceptance_length"],
            "per_position": res["per_position_acceptance"], "train_s": round(t_train, 1),
            "vocab_coverage": summary.get("vocab_coverage"),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(out / "drafter_recipes.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        del engine, drafter
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
