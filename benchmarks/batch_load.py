"""The host's share of a training batch at the GPU quickstart's settings, timed on this machine:
reading a batch's samples from a capture (`OfflineSource.get`) and padding them into one batch
(`Batch.collate`), over a synthetic SmolLM2-shaped capture (train_throughput.py's). Against a
step's time on the card, it says whether the offline data path can hold a recorded step.

    python benchmarks/batch_load.py [--samples 600] [--batches 40] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from specdec.bench.roofline import drafter_training_shapes
from specdec.train.data import GRAPH_LENGTH_MULTIPLE, OfflineSource, global_batches, padded_shape
from specdec.train.ttt import Batch
from train_throughput import synthetic_capture

BATCH_TOKENS = 4096  # the GPU quickstart's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--out", default=None, help="append the result to DIR/cpu_batch_load.jsonl")
    args = ap.parse_args()
    cfg, aux, _ = drafter_training_shapes("smollm2")
    store = synthetic_capture(Path(tempfile.mkdtemp(prefix="batch_load_")), cfg, args.samples,
                              torch.Generator().manual_seed(0), aux)
    source = OfflineSource(store)
    batches = global_batches(list(range(len(source.lengths))), source.lengths, BATCH_TOKENS, seed=0, epoch=0,
                             multiple=GRAPH_LENGTH_MULTIPLE)[: args.batches]
    read = pad = tokens = 0.0
    for gb in batches:
        shape = padded_shape(len(gb), max(source.lengths[i] for i in gb), BATCH_TOKENS, GRAPH_LENGTH_MULTIPLE)
        t = time.perf_counter()
        samples = source.get(gb, shape)
        t1 = time.perf_counter()
        Batch.collate(samples, "cpu", shape)
        read, pad = read + t1 - t, pad + time.perf_counter() - t1
        tokens += sum(len(s["input_ids"]) for s in samples)
    n = len(batches)
    result = {"batches": n, "tokens_per_batch": round(tokens / n), "read_ms": round(read / n * 1e3, 2),
              "pad_ms": round(pad / n * 1e3, 2), "threads": torch.get_num_threads()}
    print(json.dumps(result))
    if args.out:
        with open(Path(args.out) / "cpu_batch_load.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
