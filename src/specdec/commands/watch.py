"""`specdec watch`: a live view of a server's speculative decoding."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Scrape a vLLM, SGLang or specdec server every --interval seconds and show what changed in that
window: acceptance rate, mean acceptance length, per-position acceptance bars, drafts/s,
generation throughput (tok/s) and the predicted speedup. Ctrl-C exits.

examples:
  specdec watch http://localhost:8000/metrics
  specdec watch http://localhost:30000 --interval 5
  specdec watch http://localhost:8000/metrics --record watch.jsonl   # then: specdec report watch.jsonl
  specdec watch http://localhost:8000/metrics --once --interval 2    # one frame, then exit
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "watch",
        help="live acceptance / per-position / tok/s view of a server",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", metavar="URL", help="the server's /metrics URL (or its base URL)")
    p.add_argument(
        "--interval", type=float, default=2.0, metavar="S", help="seconds per frame (default: 2)"
    )
    p.add_argument("--once", action="store_true", help="render one frame and exit")
    p.add_argument(
        "--cost-ratio",
        type=float,
        default=None,
        metavar="C",
        help="draft/target step-time ratio for the predicted speedup (default: 0.05)",
    )
    p.add_argument("--k", type=int, default=None, metavar="K", help="draft tokens per step, if the metrics do not say")
    p.add_argument(
        "--record",
        default=None,
        metavar="FILE.jsonl",
        help="append every frame as one JSON line (plot it with `specdec report FILE.jsonl`)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from specdec.diagnose.watch import watch

    return watch(
        args.url,
        interval=args.interval,
        once=args.once,
        cost_ratio=args.cost_ratio,
        k=args.k,
        record=args.record,
    )
