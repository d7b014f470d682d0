"""specdec: train, export, serve, benchmark and diagnose EAGLE-3 speculative-decoding drafters.

examples:
  specdec quickstart                                   # the whole pipeline on SmolLM2-135M
  specdec generate --target smollm2-135m-instruct --ngram 3 --prompt "Explain what a hash table is."
  specdec diagnose http://localhost:8000/metrics       # acceptance verdict for vLLM / SGLang / specdec
  specdec COMMAND --help                               # every command shows runnable examples
"""

# Each subcommand lives in specdec/commands/<name>.py and exposes register(subparsers); heavy
# imports (torch, transformers) happen inside the command, so `specdec --help` answers instantly.

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import __version__
from .errors import SpecdecError

# Order is the order shown in --help.
COMMANDS = [
    "quickstart",
    "models",
    "generate",
    "regenerate",
    "capture",
    "train",
    "eval",
    "export",
    "convert",
    "serve",
    "diagnose",
    "doctor",
    "watch",
    "report",
    "bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"specdec.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"specdec.commands.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except SpecdecError as e:
        print(f"specdec {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"specdec {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
