"""An HTML page with PNG plots from the JSON of `specdec diagnose`, `eval` or `bench`.

Reads what it finds: per-position acceptance (bars), an acceptance curve (predicted speedup
against k for a few cost ratios), a time series (`specdec watch --record` frames: tok/s over
time), bench rows (tok/s per configuration). Every file is written atomically.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from ..atomic import atomic_open, atomic_path, read_jsonl
from ..errors import SpecdecError
from . import theory

COST_RATIOS = (0.02, 0.05, 0.1, 0.2)
ACCEPTANCE_KEYS = ("per_position_acceptance", "mean_acceptance_length", "acceptance_rate")


def load_input(path: str | Path) -> dict:
    """A JSON object, or a JSONL of `specdec watch --record` frames (as {"timeseries": [...]})."""
    path = Path(path)
    if not path.exists():
        raise SpecdecError(
            f"{path} does not exist: expected the --json output of specdec diagnose, eval or bench"
        )
    if path.suffix == ".jsonl":
        frames = read_jsonl(path)
        if not frames:
            raise SpecdecError(f"{path} has no complete JSON lines: expected `specdec watch --record` frames")
        return {"source": frames[-1].get("source"), "engine": frames[-1].get("engine"), "timeseries": frames}
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        # `specdec bench` prints a table and ends with one JSON line: take the last object line.
        data = None
        for line in reversed(text.splitlines()):
            if line.strip().startswith("{"):
                try:
                    data = json.loads(line)
                    break
                except json.JSONDecodeError:
                    continue
        if data is None:
            raise SpecdecError(
                f"{path} is not JSON: expected the --json output of specdec diagnose, eval or bench"
            ) from None
    if not isinstance(data, dict):
        raise SpecdecError(f"{path} holds a JSON {type(data).__name__}: expected one JSON object")
    return data


def _is_acceptance(block) -> bool:
    return isinstance(block, dict) and any(block.get(key) is not None for key in ACCEPTANCE_KEYS)


def acceptance_blocks(data: dict) -> list[tuple[str, dict]]:
    """(name, block) for every acceptance summary: the top level, label sets, nested results."""
    blocks: list[tuple[str, dict]] = []
    if _is_acceptance(data):
        blocks.append((data.get("name") or ("all" if data.get("per_label_set") else "measured"), data))
    for b in data.get("per_label_set") or []:
        if _is_acceptance(b):
            name = ", ".join(f"{k}={v}" for k, v in (b.get("labels") or {}).items()) or "label set"
            blocks.append((name, b))
    for key, value in data.items():
        if key in ("per_label_set", "totals_since_start", "rows", "timeseries"):
            continue
        if _is_acceptance(value):
            blocks.append((str(key), value))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if _is_acceptance(item) and isinstance(item, dict):
                    category = item.get("category")  # eval's per_category rows
                    name = item.get("name") or (f"category {category}" if category else f"{key}[{i}]")
                    blocks.append((str(name), item))
    return blocks


def _finite_list(values) -> list[float] | None:
    if not isinstance(values, list) or not values:
        return None
    out = []
    for v in values:
        if not isinstance(v, (int, float)) or not math.isfinite(v):
            return None
        out.append(float(v))
    return out


def curve_of(block: dict) -> tuple[list[float], str] | None:
    """The unconditional per-position curve of a block: measured, diagnose's estimate, or a fit."""
    measured = _finite_list(block.get("per_position_acceptance"))
    if measured:
        return measured, "measured"
    curve = _finite_list(block.get("acceptance_curve"))
    if curve:
        return curve, block.get("acceptance_curve_source") or "estimate"
    k = block.get("k")
    mal = block.get("mean_acceptance_length")
    if isinstance(k, int) and k > 0 and isinstance(mal, (int, float)) and mal >= 1:
        a = theory.fit_iid_rate(mal - 1.0, k)
        return theory.iid_curve(a, k), "i.i.d. fit to the mean acceptance length"
    return None


def _timeseries(data: dict) -> list[dict]:
    for key in ("timeseries", "time_series", "frames"):
        series = data.get(key)
        if isinstance(series, list):
            points = [p for p in series if isinstance(p, dict) and isinstance(p.get("tokens_per_s"), (int, float))]
            if len(points) >= 1:
                return points
    return []


def _rows(data: dict) -> list[dict]:
    rows = data.get("rows")
    if not isinstance(rows, list):
        return []
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("tokens_per_s"), (int, float))]


# ---------------------------------------------------------------------------------------------
# Plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)


def plot_per_position(blocks: list[tuple[str, dict]], path: Path) -> bool:
    plt = _plt()
    measured = [(n, _finite_list(b.get("per_position_acceptance"))) for n, b in blocks]
    measured = [(n, c) for n, c in measured if c]
    if not measured:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(measured)
    for j, (name, curve) in enumerate(measured):
        xs = [i + (j - (len(measured) - 1) / 2) * width for i in range(len(curve))]
        color = f"C{j % 10}"
        ax.bar(xs, curve, width=width, color=color, label=f"{name}: P(≥ i+1 accepted)")
        cond = theory.conditional_rates(curve)
        ax.plot(xs, [c if c is not None else float("nan") for c in cond], "o--", ms=4, color=color,
                alpha=0.7, label=f"{name}: P(i | i-1)")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(range(max(len(c) for _, c in measured)))
    ax.set_title("Per-position acceptance")
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
    return True


def plot_speedup(name: str, block: dict, path: Path, cost_ratios: tuple[float, ...]) -> bool:
    found = curve_of(block)
    if not found:
        return False
    curve, source = found
    plt = _plt()
    k_now = block.get("k") if isinstance(block.get("k"), int) else None
    k_max = max(theory.DEFAULT_K_MAX, 2 * (k_now or 0))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for c in cost_ratios:
        points = theory.speedup_by_k(curve, c, k_max)
        best = theory.best_k(curve, c, k_max)
        ax.plot([p.k for p in points], [p.speedup for p in points], marker="o", ms=3, label=f"c = {c:g}")
        if best.k:
            ax.plot([best.k], [best.speedup], "k*", ms=9)
    ax.axhline(1.0, color="grey", lw=1, ls=":")
    if k_now:
        ax.axvline(k_now, color="red", lw=1, ls="--", label=f"served k = {k_now}")
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("predicted speedup  E(k) / (1 + k·c)")
    ax.set_title(f"Predicted speedup vs k — {name} (curve: {source}; ★ best k)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    _save(fig, path)
    return True


def plot_timeseries(points: list[dict], path: Path) -> bool:
    plt = _plt()
    ts = [p.get("t") if isinstance(p.get("t"), (int, float)) else i for i, p in enumerate(points)]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(ts, [p["tokens_per_s"] for p in points], marker=".", label="generation tok/s")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tok/s")
    ax.grid(alpha=0.3)
    rates = [p.get("acceptance_rate") for p in points]
    if any(isinstance(r, (int, float)) for r in rates):
        ax2 = ax.twinx()
        ax2.plot(ts, [r if isinstance(r, (int, float)) else float("nan") for r in rates], color="tab:orange",
                 marker=".", label="acceptance rate")
        ax2.set_ylabel("acceptance rate")
        ax2.set_ylim(0, 1.05)
        ax2.legend(fontsize=7, loc="lower right")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("Throughput over time")
    _save(fig, path)
    return True


def plot_bench(rows: list[dict], path: Path) -> bool:
    plt = _plt()
    names = [str(r.get("name", i)) for i, r in enumerate(rows)]
    values = [r["tokens_per_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(rows) + 2), 3.6))
    bars = ax.bar(range(len(rows)), values, color="tab:blue")
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tok/s")
    ax.set_title("Benchmark throughput")
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
    return True


# ---------------------------------------------------------------------------------------------
# HTML


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def _table(rows: list[tuple[str, object]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _bench_table(rows: list[dict]) -> str:
    cols: list[str] = []
    for r in rows:
        for key, v in r.items():
            if key not in cols and isinstance(v, (str, int, float, bool, type(None))):
                cols.append(key)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


CSS = """
body { font-family: system-ui, sans-serif; max-width: 960px; margin: 2em auto; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .5em 0; } th, td { padding: 2px 10px; text-align: left; }
th { color: #555; font-weight: 600; } tr:nth-child(even) { background: #f6f6f6; }
.verdict { font-size: 1.2em; font-weight: 700; padding: .4em .8em; border-radius: 4px; display: inline-block; }
.v-loses { background: #fde0e0; color: #a00; } .v-marginal { background: #fff3cd; color: #8a6d00; }
.v-healthy { background: #dff5e1; color: #176b25; } img { max-width: 100%; }
"""


def build_report(
    data: dict,
    out_dir: str | Path,
    *,
    source: str = "",
    cost_ratios: tuple[float, ...] | None = None,
) -> Path:
    """Write index.html and its PNGs into out_dir; returns the path of index.html."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    blocks = acceptance_blocks(data)
    series = _timeseries(data)
    rows = _rows(data)
    if not blocks and not series and not rows:
        raise SpecdecError(
            f"nothing to plot in {source or 'the input'}: expected the --json output of specdec "
            "diagnose/eval (per_position_acceptance, mean_acceptance_length, acceptance_rate, k), "
            "of specdec bench (a rows list with tokens_per_s), or watch --record frames"
        )
    ratios = set(cost_ratios or COST_RATIOS)
    if isinstance(data.get("cost_ratio"), (int, float)):
        ratios.add(float(data["cost_ratio"]))
    ratios_t = tuple(sorted(ratios))

    parts = [f"<h1>specdec report</h1><p>input: <code>{html.escape(source)}</code>"]
    if data.get("engine"):
        parts.append(f" · engine: {html.escape(str(data['engine']))}")
    if data.get("source"):
        parts.append(f" · measured from: <code>{html.escape(str(data['source']))}</code>")
    parts.append("</p>")
    if data.get("verdict"):
        cls = {"acceptance far below reference": "v-loses",
               "speculation loses": "v-loses", "marginal": "v-marginal", "healthy": "v-healthy"}
        parts.append(
            f'<div class="verdict {cls.get(data["verdict"], "")}">'
            f"{html.escape(str(data.get('headline') or data['verdict']))}</div>"
        )
        if data.get("reasons"):
            parts.append("<h2>Why</h2><ul>" + "".join(f"<li>{html.escape(r)}</li>" for r in data["reasons"]) + "</ul>")
        if data.get("next_steps"):
            parts.append(
                "<h2>Try next</h2><ul>" + "".join(f"<li>{html.escape(r)}</li>" for r in data["next_steps"]) + "</ul>"
            )

    images: list[str] = []
    if blocks:
        parts.append("<h2>Acceptance</h2>")
        for name, b in blocks:
            parts.append(f"<h3>{html.escape(name)}</h3>")
            parts.append(
                _table([
                    ("acceptance rate", b.get("acceptance_rate")),
                    ("mean acceptance length", b.get("mean_acceptance_length")),
                    ("k", b.get("k")),
                    ("drafts", b.get("num_drafts")),
                    ("per-position acceptance", b.get("per_position_acceptance")),
                    ("predicted speedup", b.get("predicted_speedup")),
                    ("recommended k", b.get("recommended_k")),
                ])
            )
            if b is not data and b.get("verdict"):
                parts.append(f"<p><strong>{html.escape(str(b.get('headline') or b['verdict']))}</strong></p>")
                if b.get("next_steps"):
                    parts.append(
                        "<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in b["next_steps"]) + "</ul>"
                    )
        if plot_per_position(blocks, out / "per_position.png"):
            images.append("per_position.png")
            parts.append('<img src="per_position.png" alt="per-position acceptance">')
        else:
            parts.append("<p><em>per-position acceptance unavailable in this input</em></p>")
        parts.append("<h2>Predicted speedup against k</h2>")
        for i, (name, b) in enumerate(blocks):
            fname = "speedup_vs_k.png" if i == 0 else f"speedup_vs_k_{i}.png"
            if plot_speedup(name, b, out / fname, ratios_t):
                images.append(fname)
                parts.append(f'<img src="{fname}" alt="predicted speedup vs k, {html.escape(name)}">')
        parts.append(
            "<p>E(k) = 1 + Σ<sub>i&lt;k</sub> P(≥ i+1 accepted), past the measured k extrapolated with the "
            "last conditional rate; speedup = E(k) / (1 + k·c) for draft/target cost ratio c.</p>"
        )
    if series:
        parts.append("<h2>Throughput over time</h2>")
        if plot_timeseries(series, out / "throughput.png"):
            images.append("throughput.png")
            parts.append('<img src="throughput.png" alt="throughput over time">')
    if rows:
        parts.append("<h2>Benchmark</h2>")
        if plot_bench(rows, out / "bench.png"):
            images.append("bench.png")
            parts.append('<img src="bench.png" alt="tok/s per configuration">')
        parts.append(_bench_table(rows))
        meta = {k: v for k, v in data.items() if k != "rows" and isinstance(v, (str, int, float))}
        if meta:
            parts.append(_table(list(meta.items())))

    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>specdec report</title>"
        f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n"
    )
    index = out / "index.html"
    with atomic_open(index) as f:
        f.write(page)
    return index
