"""`specdec report`: an HTML page with plots from diagnose / eval / bench JSON."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Turn the JSON of `specdec diagnose --json`, `specdec eval --json` or `specdec bench --json`
(or a `specdec watch --record` JSONL) into OUT_DIR/index.html with PNG plots: per-position
acceptance, predicted speedup against k for a few draft/target cost ratios, throughput over
time, and tok/s per bench configuration. Prints the path of index.html.

examples:
  specdec diagnose http://localhost:8000/metrics --json > diag.json && specdec report diag.json
  specdec eval --json > eval.json && specdec report eval.json -o reports/eval
  specdec bench --json > bench.json && specdec report bench.json
  specdec report watch.jsonl -o reports/watch
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="HTML + PNG report from diagnose/eval/bench JSON",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", metavar="INPUT.json", help="JSON from diagnose/eval/bench, or watch JSONL")
    p.add_argument(
        "-o",
        "--out-dir",
        default=None,
        metavar="OUT_DIR",
        help="where to write index.html and the PNGs (default: INPUT_report/ next to the input)",
    )
    p.add_argument(
        "--cost-ratios",
        default=None,
        metavar="C,C,...",
        help="cost ratios for the speedup-vs-k plot (default: 0.02,0.05,0.1,0.2)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from specdec.diagnose.report import build_report, load_input
    from specdec.errors import SpecdecError

    ratios = None
    if args.cost_ratios:
        try:
            ratios = tuple(float(x) for x in args.cost_ratios.split(",") if x.strip())
        except ValueError:
            raise SpecdecError(
                f"--cost-ratios {args.cost_ratios!r} is not a list of numbers: expected e.g. 0.02,0.05,0.1"
            ) from None
    src = Path(args.input)
    out_dir = Path(args.out_dir) if args.out_dir else src.with_name(src.stem + "_report")
    index = build_report(load_input(src), out_dir, source=str(src), cost_ratios=ratios)
    print(index)
    return 0
