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
    except OSError as e:
        full = _disk_full(e)
        if full is None:
            raise
        print(f"specdec {args.command}: error: {full}", file=sys.stderr)
        return 2


def _disk_full(e: BaseException) -> str | None:
    """One line for a full disk or quota, found anywhere in the exception's chain, else None.
    Every writer is crash-safe (`specdec.atomic`), so what was written stays readable and a rerun
    of the same command resumes."""
    import errno

    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            where = f" writing {seen.filename}" if seen.filename else ""
            return (f"no space left on the device{where} ({seen.strerror}); what was written before is intact: "
                    f"free some space (or point --out elsewhere), then rerun the same command to resume")
        seen = seen.__cause__ or seen.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
