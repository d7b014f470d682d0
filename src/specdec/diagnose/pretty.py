"""The rich terminal view of a diagnose result (the same dict `--json` prints)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from .metrics import format_labels
from .verdict import FAR_BELOW, HEALTHY, LOSES, MARGINAL

STYLE = {FAR_BELOW: "bold red", LOSES: "bold red", MARGINAL: "bold yellow", HEALTHY: "bold green"}


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def bar(x: float | None, width: int = 24) -> str:
    if x is None:
        return ""
    n = max(0, min(width, round(x * width)))
    return "█" * n + "·" * (width - n)


def num(x: float | None, fmt: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, fmt)


def per_position_table(per_pos: list[float] | None, cond: list[float | None] | None) -> Table:
    t = Table(box=None, pad_edge=False)
    t.add_column("pos", justify="right")
    t.add_column("P(≥ i+1 accepted)", justify="right")
    t.add_column("P(i | i-1)", justify="right")
    t.add_column("")
    for i, p in enumerate(per_pos or []):
        c = cond[i] if cond and i < len(cond) else None
        t.add_row(str(i), pct(p), pct(c), Text(bar(p), style="cyan"))
    return t


def speedup_table(result: dict) -> Table:
    t = Table(box=None, pad_edge=False)
    t.add_column("k", justify="right")
    t.add_column("E tokens/pass", justify="right")
    t.add_column("speedup", justify="right")
    t.add_column("")
    k, best = result.get("k"), result.get("recommended_k")
    for p in result.get("speedup_by_k") or []:
        mark = []
        if p["k"] == k:
            mark.append("current")
        if p["k"] == best:
            mark.append("best")
        style = "green" if p["speedup"] >= 1 else "red"
        t.add_row(
            str(p["k"]),
            f"{p['expected_tokens']:.2f}",
            Text(f"{p['speedup']:.2f}x", style=style),
            " ".join(mark),
        )
    return t


def headline(block: dict) -> Text:
    verdict = block["verdict"]
    head = Text()
    head.append(verdict.upper(), style=STYLE.get(verdict, "bold"))
    rest = block["headline"].split(":", 1)[1] if ":" in block["headline"] else " " + block["headline"]
    head.append(rest)
    return head


def facts_table(block: dict, result: dict) -> Table:
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    counts = ""
    if block.get("num_accepted_tokens") is not None and block.get("num_draft_tokens"):
        counts = f"  ({num(block['num_accepted_tokens'])} / {num(block['num_draft_tokens'])} draft tokens)"
    facts.add_row("acceptance rate", pct(block.get("acceptance_rate")) + counts)
    mal = block.get("mean_acceptance_length")
    facts.add_row("mean acceptance length", "n/a" if mal is None else f"{mal:.2f} tokens per target pass")
    facts.add_row("drafts (steps)", num(block.get("num_drafts")))
    facts.add_row("k", f"{block.get('k')}  ({block.get('k_source') or 'unknown'})")
    if block is result:
        basis = result["basis"]
        if result.get("window_s") and basis == "window":
            basis += f" of {result['window_s']:.1f} s"
        facts.add_row("measured over", basis)
        if result.get("throughput_tokens_per_s") is not None:
            facts.add_row("generation throughput", f"{result['throughput_tokens_per_s']:.1f} tok/s")
    be = block.get("break_even_cost_ratio")
    facts.add_row("break-even cost ratio", "n/a" if be is None else f"c < {max(be, 0):.3f}")
    c_note = " (assumed)" if block.get("cost_ratio_assumed") else ""
    facts.add_row("cost ratio", f"{block['cost_ratio']:g}{c_note}")
    if block.get("recommended_k") is not None:
        rk = block["recommended_k"]
        facts.add_row(
            "recommended k",
            f"{rk}  ({block['recommended_speedup']:.2f}x)" if rk else "0  (speculation off)",
        )
    return facts


def bullets(title: str, lines: list[str], mark: str) -> Text:
    out = Text(title + "\n", style="bold")
    for line in lines:
        out.append(f"  {mark} {line}\n")
    return out


def section(block: dict, result: dict) -> list:
    parts: list = [facts_table(block, result), Text("")]
    if block.get("per_position_acceptance"):
        parts += [
            Text("Per-position acceptance", style="bold"),
            per_position_table(block["per_position_acceptance"], block.get("per_position_conditional")),
            Text(""),
        ]
    else:
        parts += [Text("Per-position acceptance: unavailable (no per-position series)", style="dim"), Text("")]
    if block.get("speedup_by_k"):
        parts += [
            Text(
                f"Predicted speedup by k at c = {block['cost_ratio']:g} "
                f"(curve: {block.get('acceptance_curve_source')})",
                style="bold",
            ),
            speedup_table(block),
            Text(""),
        ]
    parts.append(bullets("Why", block.get("reasons") or [], "•"))
    parts.append(bullets("Try next", block.get("next_steps") or [], "→"))
    return parts


def label_set_table(result: dict) -> Table:
    t = Table(title="Per label set", title_justify="left")
    for col in ("labels", "acceptance", "mean len", "k", "speedup", "verdict"):
        t.add_column(col)
    for b in result["per_label_set"]:
        s = b.get("predicted_speedup")
        mal = b.get("mean_acceptance_length")
        t.add_row(
            format_labels(b["labels"]),
            pct(b.get("acceptance_rate")),
            "n/a" if mal is None else f"{mal:.2f}",
            str(b.get("k")),
            "n/a" if s is None else f"{s:.2f}x",
            Text(b["verdict"], style=STYLE.get(b["verdict"], "")),
        )
    return t


def render(result: dict) -> Group:
    title = f"specdec diagnose · {result['engine']} · {result['source']}"
    if result.get("per_label_set"):
        title += " · all label sets"
    parts: list = [Panel(headline(result), title=title, title_align="left")]
    if result.get("per_label_set"):
        parts += [label_set_table(result), Text("")]
    parts += section(result, result)
    for block in result.get("per_label_set") or []:
        parts.append(Rule(format_labels(block["labels"]), align="left"))
        parts.append(headline(block))
        parts += section(block, result)

    tot = result.get("totals_since_start")
    if tot and result.get("window_s"):
        line = Text("Totals since start: ", style="bold")
        if "acceptance_rate" in tot:
            mal = tot.get("mean_acceptance_length")
            line.append(
                f"acceptance {pct(tot.get('acceptance_rate'))}, mean length "
                f"{'n/a' if mal is None else f'{mal:.2f}'}, {num(tot.get('num_drafts'))} drafts"
            )
        else:
            line.append(f"mean acceptance length {tot['mean_acceptance_length']:.2f} ({tot['source']})")
        parts.append(line)
    return Group(*parts)


def print_result(result: dict, console: Console | None = None) -> None:
    (console or Console()).print(render(result))
