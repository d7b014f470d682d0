"""Time `count_tokens` (train/vocab.py) the way `specdec train --online` calls it: over the rendered
ShareGPT first turns of a regenerate-style JSONL, SmolLM2's vocab. `--module FILE` times another
version of vocab.py (e.g. `git show REV:src/specdec/train/vocab.py > old.py`) for a before/after.

    python benchmarks/vocab_count.py --data all.jsonl [--module old.py]
"""

import argparse
import importlib.util
import json
import time

import torch

from specdec.capture.run import load_records
from specdec.models.target import load_target
from specdec.train.data import online_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="JSONL of {id, messages} with assistant turns")
    ap.add_argument("--module", default="src/specdec/train/vocab.py", help="the vocab.py to time")
    args = ap.parse_args()
    target = load_target("smollm2-135m-instruct", device="cpu")
    source = online_source(target, load_records(args.data), None)
    spec = importlib.util.spec_from_file_location("vocab_under_test", args.module)
    vocab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vocab)
    t = time.perf_counter()
    masked, every = vocab.count_tokens(source.token_samples(), target.vocab_size)
    print(json.dumps({"module": args.module, "samples": len(source.ids), "seconds": round(time.perf_counter() - t, 2),
                      "assistant_tokens": int(masked.sum()), "tokens": int(every.sum()),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
