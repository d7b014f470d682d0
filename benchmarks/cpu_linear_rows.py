"""One fp32 linear layer over 1-8 rows on this CPU: `F.linear` against the routing that
`load_target` installs on fp32 CPU targets (specdec.models.cpu_products), for the weight shapes that
dominate SmolLM2-135M's and Qwen2.5-1.5B's decode and verify steps.

    python benchmarks/cpu_linear_rows.py

Writes benchmarks/results/cpu_linear_rows.json (median ms of 15 calls after 2 warm-up calls).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.bench.roofline import device_info
from specdec.models.cpu_products import route_few_row_products

SHAPES = {  # name: (out_features, in_features)
    "smollm2 lm_head": (49152, 576),
    "qwen1.5b gate/up": (8960, 1536),
    "qwen1.5b down": (1536, 8960),
    "qwen1.5b lm_head": (151936, 1536),
}
ROWS = (1, 2, 3, 4, 6, 8)


def median_ms(fn, reps: int = 15) -> float:
    fn(), fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 2)


def main() -> None:
    out = {"env": device_info(), "threads": torch.get_num_threads(), "ms": {}}
    with torch.no_grad():
        for name, (o, i) in SHAPES.items():
            layer = nn.Linear(i, o, bias=False)
            plain = {}
            for r in ROWS:
                x = torch.randn(r, i)
                plain[r] = median_ms(lambda: F.linear(x, layer.weight))
            route_few_row_products(layer)
            routed = {r: median_ms(lambda x=torch.randn(r, i): layer(x)) for r in ROWS}
            out["ms"][name] = {r: {"F.linear": plain[r], "routed": routed[r]} for r in ROWS}
            print(f"{name:18s}", "  ".join(f"{r}: {plain[r]:.2f} / {routed[r]:.2f}" for r in ROWS), flush=True)
    path = Path(__file__).resolve().parent / "results" / "cpu_linear_rows.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
