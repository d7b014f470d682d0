"""Plots for BENCHMARKS.md from the JSON files under benchmarks/results/ (runs on any machine).

    python benchmarks/plot.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

R = Path(__file__).resolve().parent / "results"


def load(name: str) -> dict:
    return json.loads((R / name).read_text())


def plot_8b() -> None:
    a, b = load("h200_roofline_8b.json"), load("h200_roofline_8b_nocd.json")
    floor = a["floor_ms"]["all_weights"]
    bars = {
        "HF eager": a["hf_eager_ms"],
        "eager step\nin 1 graph": a["variants"]["graph"]["1"]["ms"],
        "inductor +\ncoord. descent": a["variants"]["cd"]["1"]["ms"],
        "inductor,\ncuBLAS GEMV": b["variants"]["nocd"]["1"]["ms"],
    }
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.bar(list(bars), list(bars.values()), color=["#999", "#6a9", "#59c", "#c75"])
    ax.axhline(floor, color="k", ls="--", lw=1, label=f"HBM floor {floor:.2f} ms")
    ax.axhline(floor / 0.85, color="r", ls=":", lw=1, label=f"bar: 85% of floor ({floor / 0.85:.2f} ms)")
    ax.set_yscale("log")
    ax.set_ylabel("ms per token (plain decode, batch 1)")
    for i, v in enumerate(bars.values()):
        ax.text(i, v * 1.05, f"{v:.2f}", ha="center", fontsize=8)
    ax.legend(fontsize=8)
    ax.set_title("Llama-3.1-8B shapes, bf16, H200")
    ax.tick_params(axis="x", labelsize=7)
    for name, res, label in ((("nocd"), b, "inductor, cuBLAS"), ("cd", a, "inductor + coord. descent"),
                             ("graph", a, "eager step in a graph")):
        rows = res["variants"].get(name, {})
        if "1" not in rows:
            continue
        one = b["variants"]["nocd"]["1"]["ms"]  # ratios against the best one-token step
        Ts = sorted(int(t) for t in rows)
        ax2.plot(Ts, [rows[str(t)]["ms"] / one for t in Ts], marker="o", label=label)
    ax2.axhline(1.1, color="r", ls=":", lw=1, label="bar: 8 tokens <= 1.1x")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("tokens verified in one step (T)")
    ax2.set_ylabel("step time / best one-token step")
    ax2.set_title("cost of verifying T tokens")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(R / "h200_8b_roofline.png", dpi=110)


def plot_smollm2() -> None:
    a, e = load("h200_smollm2_shapes.json"), load("h200_smollm2_shapes_e2e.json")
    bars = {
        "HF eager": a["hf_eager_ms"],
        "eager step\nin 1 graph": a["variants"]["graph"]["1"]["ms"],
        "inductor,\ncuBLAS GEMV": a["variants"]["nocd"]["1"]["ms"],
        "inductor +\ncoord. descent": a["variants"]["cd"]["1"]["ms"],
        "generate(),\nplain": e["e2e"]["plain"]["ms_per_token"],
    }
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.bar(list(bars), list(bars.values()), color=["#999", "#6a9", "#c75", "#59c", "#48a"])
    ax.axhline(1.0, color="r", ls=":", lw=1, label="bar: 1.0 ms/token")
    ax.axhline(a["floor_ms"], color="k", ls="--", lw=1, label=f"HBM floor {a['floor_ms']:.3f} ms")
    ax.set_yscale("log")
    ax.set_ylabel("ms per token (plain decode, batch 1)")
    for i, v in enumerate(bars.values()):
        ax.text(i, v * 1.05, f"{v:.2f}", ha="center", fontsize=8)
    ax.legend(fontsize=8)
    ax.set_title("SmolLM2-135M shapes, bf16, H200")
    ax.tick_params(axis="x", labelsize=7)
    rows = a["variants"]["cd"]
    Ts = sorted(int(t) for t in rows)
    ax2.plot(Ts, [rows[str(t)]["ms"] / rows["1"]["ms"] for t in Ts], marker="o", label="inductor + coord. descent")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("tokens in one step (T)")
    ax2.set_ylabel("step time / one-token step")
    ax2.set_title("cost of verifying T tokens")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(R / "h200_smollm2.png", dpi=110)


if __name__ == "__main__":
    plot_8b()
    plot_smollm2()
    print("wrote", *sorted(p.name for p in R.glob("*.png")))
