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


def plot_recipes() -> None:
    """Drafter recipes at CPU size (H200) and the GPU quickstart's held-out curve."""
    import re

    rows = [json.loads(line) for line in (R / "h200_drafter_recipes.jsonl").read_text().splitlines() if line]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [r["recipe"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["simulated_al"] for r in rows], 0.4, label="held-out simulated")
    ax.bar([i + 0.2 for i in x], [r["measured_al_k5"] for r in rows], 0.4, label="measured, MT-Bench, k=5")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(1.0, max(r["simulated_al"] for r in rows) + 0.15)
    ax.axhline(2.0, color="grey", ls="--", lw=0.8)
    ax.set_ylabel("mean acceptance length")
    ax.set_title("SmolLM2-135M, 33K-token CPU-size capture")
    ax.legend(fontsize=8)
    log = (R / "h200_quickstart_gpu.log").read_text()
    sims = [float(v) for v in re.findall(r"simulated acceptance length ([0-9.]+)", log)]
    steps = [50 * (i + 1) for i in range(len(sims))]
    bx.plot(steps, sims, marker="o")
    bx.axhline(2.0, color="grey", ls="--", lw=0.8)
    bx.set_xlabel("optimizer step (16,384 tokens per batch, 95 per epoch)")
    bx.set_ylabel("held-out simulated acceptance length")
    bx.set_title("GPU quickstart: 4,000 prompts, 1.04M tokens")
    fig.tight_layout()
    fig.savefig(R / "h200_drafter_recipes.png", dpi=120)


def plot_bench(name: str, png: str, title: str) -> None:
    """A `specdec bench --out` JSON: tok/s per method, the acceptance length over each bar."""
    d = load(name)
    rows = [r for r in d["rows"] if r.get("tok_s")]
    plain = next((r["tok_s"] for r in rows if r["method"] == "specdec-plain"), None)
    colors = ["#999" if r["engine"] == "hf" else "#59c" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    ax.bar([r["method"] for r in rows], [r["tok_s"] for r in rows], color=colors)
    if plain:
        ax.axhline(plain, color="k", ls="--", lw=0.8, label=f"specdec plain {plain:.2f} tok/s")
        ax.legend(fontsize=8)
    for i, r in enumerate(rows):
        label = f"{r['tok_s']:.2f}" + (f"\nAL {r['mean_acceptance_length']:.2f}"
                                       if r.get("mean_acceptance_length") else "")
        ax.text(i, r["tok_s"] * 1.01, label, ha="center", va="bottom", fontsize=7)
    ax.set_ylim(0, 1.18 * max(r["tok_s"] for r in rows))
    ax.set_ylabel("tok/s (greedy; grey: HF transformers)")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(R / png, dpi=110)


def plot_regen() -> None:
    """Regeneration tok/s, HF generate against the batch decoder, on the same batches (one bar pair per
    device; the last line of each results file)."""
    runs = [(label, name) for label, name in (("H200, batch 256", "h200_regen_throughput.jsonl"),
                                              ("2-core CPU, batch 64", "cpu_regen_throughput.jsonl"))
            if (R / name).exists()]
    if not runs:
        return
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.6), squeeze=False)
    for ax, (label, name) in zip(axes[0], runs):
        d = json.loads((R / name).read_text().strip().splitlines()[-1])
        vals = [d["hf_tok_s"], d["batch_tok_s"]]
        ax.bar(["HF generate", "batch decoder"], vals, color=["#999", "#59c"])
        for i, v in enumerate(vals):
            ax.text(i, v * 1.01, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.15 * max(vals))
        ax.set_ylabel("new tokens / s")
        ax.set_title(f"{label}: {d['speedup']:.1f}x ({d['prompts']} prompts, {d['dtype'].split('.')[-1]})", fontsize=9)
    fig.suptitle("regenerate, SmolLM2-135M-Instruct, greedy", fontsize=10)
    fig.tight_layout()
    fig.savefig(R / "regen_throughput.png", dpi=110)


def plot_trees() -> None:
    """Acceptance length and speed against plain decoding per tree shape, the 14,000-prompt drafter
    (one `specdec eval --compare-plain` per tree)."""
    shapes = [t for t in ("6-8-48", "8-8-64", "10-8-96") if (R / f"h200_eval_14k_tree_{t}.json").exists()]
    if not shapes:
        return
    runs = [load(f"h200_eval_14k_tree_{t}.json") for t in shapes]
    labels = [t.replace("-", " / ") for t in shapes]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.4, 3.4))
    al = [r["mean_acceptance_length"] for r in runs]
    a1.bar(labels, al, color="#59c")
    a1.axhline(3.5, color="#c33", lw=1, ls="--", label="the bar: 3.5")
    for i, v in enumerate(al):
        a1.text(i, v * 1.01, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    a1.set_ylim(0, 4.2)
    a1.set_ylabel("mean acceptance length")
    a1.set_xlabel("tree: depth / top-k / tokens")
    a1.legend(fontsize=8, loc="lower right")
    sp = [r["speedup"] for r in runs]
    a2.bar(labels, sp, color="#999")
    a2.axhline(1.0, color="k", lw=1)
    for i, (v, r) in enumerate(zip(sp, runs)):
        a2.text(i, v * 1.01, f"{v:.2f}x\n{r['tokens_per_s']:,.0f} tok/s", ha="center", va="bottom", fontsize=8)
    a2.set_ylim(0, 1.25)
    a2.set_ylabel("tok/s against plain decoding")
    a2.set_xlabel("tree: depth / top-k / tokens")
    fig.suptitle("SmolLM2-135M-Instruct, H200, bf16: the 14,000-prompt drafter's trees, 10 MT-Bench questions",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(R / "h200_trees_14k.png", dpi=110)


def plot_train_throughput() -> None:
    """Drafter training tok/s of the loop before and after the batches were loaded ahead."""
    if not (R / "h200_train_throughput.jsonl").exists():
        return
    rows = [json.loads(line) for line in (R / "h200_train_throughput.jsonl").read_text().splitlines() if line]
    kinds = [k for k in ("steps", "quickstart") if any(r["row"] == k for r in rows)]
    tags = [t for t in ("before", "after") if any(r["tag"] == t for r in rows)]
    fig, ax = plt.subplots(figsize=(5.6, 3.4))
    width = 0.38
    for j, tag in enumerate(tags):
        vals = [next(r["tokens_per_s"] for r in rows if r["tag"] == tag and r["row"] == k) for k in kinds]
        xs = [i + (j - 0.5) * width for i in range(len(kinds))]
        ax.bar(xs, vals, width, label=tag, color=["#999", "#59c"][j])
        for x, v in zip(xs, vals):
            ax.text(x, v * 1.01, f"{v / 1e3:.1f}K", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.15 * max(r["tokens_per_s"] for r in rows))
    ax.set_xticks(range(len(kinds)), ["steps only", "with eval + checkpoints"])
    ax.set_ylabel("training tokens / s")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("drafter training, SmolLM2 shapes, H200 (4,096 tokens/batch, TTT 7)", fontsize=9)
    fig.tight_layout()
    fig.savefig(R / "h200_train_throughput.png", dpi=110)


def plot_packed() -> None:
    """Per product, the best TB/s of each way to stream a weight for 8 tokens; then the 8B step of
    1 and 8 tokens with row-major and packed weights, in one process and in fresh ones."""
    rv = load("h200_rows_variants.json")
    kinds = ["gemv1", "rows-autotuned", "cublas", "tma", "blocked", "splitk"]
    labels = ["one-token GEMV", "rows kernel", "cuBLAS (8 rows)", "TMA-fed rows", "blocked layout", "split K"]
    shapes = list(rv["shapes"])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    w = 0.8 / len(kinds)
    for j, (kind, label) in enumerate(zip(kinds, labels)):
        xs, ys = [], []
        for i, name in enumerate(shapes):
            best = [v["TBps"] for k, v in rv["shapes"][name]["variants"].items() if "TBps" in v
                    and (k == kind or k.startswith(kind + "@"))]
            if best:
                xs.append(i + (j - len(kinds) / 2 + 0.5) * w)
                ys.append(max(best))
        ax.bar(xs, ys, w, label=label)
    ax.axhline(rv["copy_TBps"], color="k", ls="--", lw=1, label=f"copy {rv['copy_TBps']:.2f} TB/s")
    ax.set_xticks(range(len(shapes)), [f"{n}\n{rv['shapes'][n]['MB']:.0f} MB" for n in shapes])
    ax.set_ylabel("TB/s of weight (8 tokens; GEMV: 1)")
    ax.set_ylim(1.5, 4.8)
    ax.set_title("8B products, H200, each launch in a CUDA graph", fontsize=9)
    ax.legend(fontsize=7, ncol=2)

    runs = [("one process", "h200_roofline_8b_pack.json", "default", "row-major"),
            ("one process", "h200_roofline_8b_pack.json", "default@pack1", "packed"),
            ("fresh 1", "h200_roofline_8b_pack_process1.json", "default@pack1", "packed"),
            ("fresh 2", "h200_roofline_8b_pack_process2.json", "default@pack1", "packed")]
    for i, (where, name, key, layout) in enumerate(runs):
        d = load(name)
        t1, t8 = d["variants"][key]["1"]["ms"], d["variants"][key]["8"]["ms"]
        ax2.bar([i - 0.2, i + 0.2], [t1, t8], 0.4, color=["#59c", "#c75"],
                label=["1 token", "8 tokens"] if i == 0 else None)
        ax2.text(i + 0.2, t8 + 0.02, f"{t8 / t1:.3f}x", ha="center", fontsize=8)
    floor = load("h200_roofline_8b_pack.json")["floor_ms"]["all_weights"]
    ax2.axhline(floor, color="k", ls="--", lw=1, label=f"HBM floor {floor:.2f} ms")
    ax2.set_xticks(range(len(runs)), [f"{r[3]}\n{r[0]}" for r in runs], fontsize=8)
    ax2.set_ylim(3.5, 4.8)
    ax2.set_ylabel("ms per step (8B shapes)")
    ax2.set_title("8-token step / 1-token step (bar: <= 1.1x)", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(R / "h200_8b_packed.png", dpi=110)


if __name__ == "__main__":
    plot_8b()
    plot_smollm2()
    plot_recipes()
    plot_packed()
    plot_regen()
    plot_trees()
    plot_train_throughput()
    if (R / "h200_bench_quickstart_14k.json").exists():
        plot_bench("h200_bench_quickstart_14k.json", "h200_bench_quickstart_14k.png",
                   "SmolLM2-135M-Instruct, H200, bf16: the drafter of the quickstart on 14,000 prompts")
    for dtype, suffix in (("bf16", ""), ("fp32", "_fp32"), ("fp32, few-row products routed", "_fp32_routed"),
                          ("bf16, CPU fast path", "_fast")):
        if (R / f"cpu_qwen15_head_to_head{suffix}.json").exists():
            plot_bench(f"cpu_qwen15_head_to_head{suffix}.json", f"cpu_qwen15_head_to_head{suffix}.png",
                       f"Qwen2.5-Coder-1.5B-Instruct, 2-core CPU, {dtype}: HF assisted (0.5B) vs specdec EAGLE-3")
    for name, what in (("cpu_smollm2_fast_path_bench", "CPU fast path"),
                       ("cpu_smollm2_reference_bench", "reference engine")):
        if (R / f"{name}.json").exists():
            plot_bench(f"{name}.json", f"{name}.png",
                       f"SmolLM2-135M-Instruct, 2-core CPU, bf16, GPU-trained drafter: {what}")
    print("wrote", *sorted(p.name for p in R.glob("*.png")))
