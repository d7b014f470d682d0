"""Does training's simulated acceptance predict what the engine measures on the same prompts?

The target answers the evaluation prompts (greedy, as the engine does), the answers are captured
like training data, and the drafter's training-time-test accuracy on them gives a simulated chain
acceptance. Against the engine's measured acceptance on the same prompts it separates the two
reasons a drafter accepts less than its held-out figure: a gap between training and inference
(simulated on these prompts >> measured) or prompts unlike the training data (simulated ~ measured,
both below the held-out figure).

  python benchmarks/sim_vs_engine.py --target smollm2-135m-instruct --drafter runs/quickstart/train/drafter \
      --prompts mt-bench --limit 10 --max-new-tokens 96 --k 5 --out runs/sim_vs_engine
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch

from specdec.capture.run import load_records, run_capture
from specdec.capture.store import CaptureStore
from specdec.data.datasets import load_conversations
from specdec.data.regenerate import RegenConfig, regenerate_local
from specdec.engine.choice import make_engine
from specdec.evaluate import evaluate
from specdec.models.formats import load_drafter
from specdec.models.target import load_target
from specdec.train.data import OfflineSource
from specdec.train.loop import DrafterTTT, evaluate_heldout
from specdec.train.ttt import TargetHead


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", default="mt-bench")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="runs/sim_vs_engine")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    target = load_target(args.target, dtype=args.dtype)
    drafter = load_drafter(args.drafter, target, dtype=torch.float32)
    questions = load_conversations(args.prompts, limit=args.limit, seed=0)
    regenerate_local(target, questions, out / "regen.jsonl",
                     RegenConfig(max_new_tokens=args.max_new_tokens, single_turn=True), batch_size=len(questions))
    run_capture(target, load_records(str(out / "regen.jsonl")), out / "capture", max_length=None)
    source = OfflineSource(CaptureStore(out / "capture"))
    module = DrafterTTT(drafter, TargetHead.from_target(target), steps=args.k, decay=1.0)
    bf16 = target.dtype == torch.bfloat16
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    sim = evaluate_heldout(module, source, list(range(len(source.ids))), 4096, torch.device("cpu"),
                           torch.bfloat16 if bf16 else torch.float32, autocast)

    engine = make_engine(target, drafter=load_drafter(args.drafter, target, dtype=target.dtype), k=args.k)
    measured = evaluate(engine, target.tokenizer, questions, max_new_tokens=args.max_new_tokens)
    result = {"prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens, "k": args.k,
              "dtype": str(target.dtype), "simulated": sim,
              "measured": {k: measured[k] for k in ("mean_acceptance_length", "per_position_acceptance")}}
    print(f"simulated on these prompts: acceptance length {sim['simulated_acceptance_length_k5']:.2f} over "
          f"every position, {sim['walked_acceptance_length_k5']:.2f} as the engine steps; "
          f"chain {sim['chain_acceptance']}")
    print(f"measured by the engine:     acceptance length {measured['mean_acceptance_length']:.2f}, "
          f"per position {[round(x, 4) for x in measured['per_position_acceptance']]}")
    (out / "sim_vs_engine.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
