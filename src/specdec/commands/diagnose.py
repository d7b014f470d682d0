"""`specdec diagnose`: is speculative decoding paying on a live server, and if not, why?"""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Read speculative-decoding metrics from a vLLM, SGLang or specdec server and say whether
speculation pays: acceptance rate, mean acceptance length, per-position acceptance, expected
tokens per target pass, predicted speedup at draft/target cost ratio c, the best k, and what to
try next.

SOURCE is a /metrics URL (scraped twice, --window seconds apart, and judged on the counter
deltas), a saved metrics text file, or - for stdin (judged on totals since server start).

Counters alone cannot say whether an acceptance is good: it is held against a reference, the
acceptance `specdec train` recorded for the drafter (--drafter DIR), else published EAGLE-3
figures (labelled as such; not for servers that say they run n-gram or plain decoding). Far
below it, the verdict is "acceptance far below reference" at any cost ratio: run `specdec doctor
--server`. The cost ratio c is assumed (0.05) unless --cost-ratio gives it; the verdict then
says so and shows the range of c over which it holds.

exit status: 0 no problem found; 1 speculation loses or acceptance is far below the reference;
2 could not read the metrics.

examples:
  specdec diagnose http://localhost:8000/metrics
  specdec diagnose http://localhost:30000 --window 30 --cost-ratio 0.08
  curl -s http://localhost:8000/metrics > metrics.txt && specdec diagnose metrics.txt --json
  curl -s http://localhost:8000/metrics | specdec diagnose -
  specdec diagnose v0-metrics.txt --k 5     # vLLM v0 scrapes do not say k
  specdec diagnose http://localhost:8000 --drafter runs/quickstart/train/drafter   # against its own reference
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "diagnose",
        help="verdict on a live server's speculative decoding (vLLM, SGLang, specdec)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", metavar="SOURCE", help="/metrics URL, saved metrics file, or - for stdin")
    p.add_argument(
        "--window",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between the two scrapes of a URL (default: 10)",
    )
    p.add_argument(
        "--cost-ratio",
        type=float,
        default=None,
        metavar="C",
        help="draft step time / target step time (default: 0.05, assumed)",
    )
    p.add_argument(
        "--k",
        type=int,
        default=None,
        metavar="K",
        help="draft tokens per step, when the metrics do not say (vLLM v0); overrides inference",
    )
    p.add_argument("--drafter", metavar="DIR",
                   help="the served drafter's folder: hold the live acceptance against what training recorded")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from specdec.diagnose.core import PROBLEMS, diagnose, drafter_reference

    reference = drafter_reference(args.drafter) if args.drafter else None
    result = diagnose(args.source, window=args.window, cost_ratio=args.cost_ratio, k=args.k, reference=reference)
    if args.json:
        print(json.dumps(result))
    else:
        from specdec.diagnose.pretty import print_result

        print_result(result)
    return 1 if result["verdict"] in PROBLEMS else 0
