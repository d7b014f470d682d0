"""A live view of a server's speculative decoding: windowed acceptance, per-position bars, tok/s.

Each frame is the delta between two scrapes `interval` seconds apart, so it shows what the server
does now, not its lifetime average. `frame_data` computes a frame as a JSON-ready dict (what
`--record` appends and `specdec report` plots as a time series); `render_frame` draws it.
"""

from __future__ import annotations

import datetime as _dt
import time
from typing import Callable

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..errors import SpecdecError
from . import metrics as m
from .acceptance import Acceptance, summarize
from .pretty import STYLE, bar, pct
from .verdict import judge


def _block(acc: Acceptance, dt: float, cost_ratio: float | None) -> dict:
    v = judge(acc, cost_ratio=cost_ratio)
    return {
        "labels": dict(acc.labels),
        "acceptance_rate": acc.acceptance_rate,
        "mean_acceptance_length": acc.mean_acceptance_length,
        "per_position_acceptance": acc.per_position,
        "k": acc.k,
        "num_drafts": acc.num_drafts,
        "drafts_per_s": acc.num_drafts / dt if acc.num_drafts is not None and dt > 0 else None,
        "predicted_speedup": v.predicted_speedup,
        "verdict": v.verdict,
    }


def frame_data(
    before: m.Scrape,
    after: m.Scrape,
    *,
    cost_ratio: float | None = None,
    k: int | None = None,
    t0: float | None = None,
) -> dict:
    """One frame: what changed between two scrapes, per label set and overall."""
    dt = max(after.taken_at - before.taken_at, 1e-9)
    d = m.delta(before, after)
    gen = d.total_generation_tokens
    throughput = gen / dt if gen is not None else d.gen_throughput_gauge
    data = {
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "t": after.taken_at - (t0 if t0 is not None else before.taken_at),
        "source": after.source,
        "engine": after.engine,
        "window_s": dt,
        "tokens_per_s": throughput,
        "overall": None,
        "per_label_set": [],
        "totals_since_start": None,
        "error": None,
    }
    if not after.has_spec:
        data["error"] = "no speculative-decoding metrics in this scrape"
        return data
    overall, parts = summarize(d, k=k)
    data["overall"] = _block(overall, dt, cost_ratio)
    data["acceptance_rate"] = overall.acceptance_rate  # flat copies: easy to plot over time
    data["mean_acceptance_length"] = overall.mean_acceptance_length
    if len(parts) > 1:
        data["per_label_set"] = [_block(p, dt, cost_ratio) for p in parts]
    if after.engine != "sglang":
        total, _ = summarize(after, k=k)
        data["totals_since_start"] = {
            "acceptance_rate": total.acceptance_rate,
            "mean_acceptance_length": total.mean_acceptance_length,
            "num_drafts": total.num_drafts,
        }
    elif after.server_info_accept_length:
        data["totals_since_start"] = {"mean_acceptance_length": after.server_info_accept_length}
    return data


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def render_frame(data: dict) -> Panel:
    """The live view of one frame."""
    title = f"specdec watch · {data['engine']} · {data['source']}"
    sub = f"window {data['window_s']:.1f} s · {data['time']}"
    parts: list = []
    tps = data.get("tokens_per_s")
    head = Text()
    head.append("throughput ", style="bold")
    head.append(f"{_num(tps, ',.1f')} tok/s" if tps is not None else "n/a (no generation counter)")
    parts.append(head)
    if data.get("error"):
        parts.append(Text(data["error"], style="bold red"))
    o = data.get("overall")
    if o:
        if not o.get("num_drafts") and data["engine"] != "sglang":
            parts.append(Text(f"idle: no drafts in the last {data['window_s']:.1f} s", style="dim"))
        table = Table(box=None, pad_edge=False)
        for col in ("", "acceptance", "mean len", "k", "drafts/s", "speedup", "verdict"):
            table.add_column(col, justify="right" if col not in ("", "verdict") else "left")
        rows = [("all", o)] + [(m.format_labels(b["labels"]), b) for b in data.get("per_label_set") or []]
        for name, b in rows:
            s = b.get("predicted_speedup")
            table.add_row(
                name,
                pct(b.get("acceptance_rate")),
                _num(b.get("mean_acceptance_length"), ".2f"),
                str(b.get("k") if b.get("k") is not None else "n/a"),
                _num(b.get("drafts_per_s"), ",.1f"),
                "n/a" if s is None else f"{s:.2f}x",
                Text(b.get("verdict") or "", style=STYLE.get(b.get("verdict"), "")),
            )
        parts.append(table)
        bars = Table(box=None, pad_edge=False, title="per-position acceptance (window)", title_justify="left")
        bars.add_column("pos", justify="right")
        bars.add_column("", justify="right")
        bars.add_column("")
        per_pos = o.get("per_position_acceptance")
        if per_pos:
            for i, p in enumerate(per_pos):
                bars.add_row(str(i), pct(p), Text(bar(p, 40), style="cyan"))
            parts.append(bars)
        else:
            parts.append(Text("per-position acceptance: unavailable", style="dim"))
    tot = data.get("totals_since_start")
    if tot:
        line = Text("since start: ", style="bold")
        if tot.get("acceptance_rate") is not None:
            line.append(f"acceptance {pct(tot['acceptance_rate'])}, ")
        line.append(f"mean length {_num(tot.get('mean_acceptance_length'), '.2f')}")
        if tot.get("num_drafts") is not None:
            line.append(f", {tot['num_drafts']:,.0f} drafts")
        parts.append(line)
    return Panel(Group(*parts), title=title, subtitle=sub, title_align="left", subtitle_align="right")


def watch(
    url: str,
    *,
    interval: float = 2.0,
    once: bool = False,
    cost_ratio: float | None = None,
    k: int | None = None,
    console: Console | None = None,
    record: str | None = None,
    max_frames: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Refresh a frame every `interval` seconds until Ctrl-C (or one frame with `once`)."""
    if not m.is_url(url):
        raise SpecdecError(
            f"{url} is not a URL: watch needs a live server, e.g. http://localhost:8000/metrics "
            "(for a saved file use `specdec diagnose FILE`)"
        )
    if interval <= 0:
        raise SpecdecError(f"--interval {interval} is invalid: expected seconds > 0, e.g. 2")
    console = console or Console()
    first = m.require_spec(m.scrape_url(url))
    t0 = first.taken_at
    rec = None
    if record:
        rec = open(record, "a", encoding="utf-8")  # noqa: SIM115 (closed in finally)
    try:
        if once:
            sleep(interval)
            data = frame_data(first, m.scrape_url(url), cost_ratio=cost_ratio, k=k, t0=t0)
            _record(rec, data)
            console.print(render_frame(data))
            return 0
        from rich.live import Live

        before = first
        frames = 0
        waiting = Panel(Text(f"first window: {interval:g} s ..."), title=f"specdec watch · {url}")
        try:
            with Live(waiting, console=console, refresh_per_second=4, transient=False) as live:
                while max_frames is None or frames < max_frames:
                    sleep(interval)
                    try:
                        after = m.scrape_url(url)
                    except SpecdecError as e:
                        live.update(Panel(Text(str(e), style="bold red"), title=f"specdec watch · {url}"))
                        continue
                    data = frame_data(before, after, cost_ratio=cost_ratio, k=k, t0=t0)
                    _record(rec, data)
                    live.update(render_frame(data))
                    before = after
                    frames += 1
        except KeyboardInterrupt:
            console.print("[dim]stopped[/dim]")
        return 0
    finally:
        if rec is not None:
            rec.close()


def _record(f, data: dict) -> None:
    if f is not None:
        from ..atomic import append_jsonl

        append_jsonl(f, data)
