"""The main job end to end on a tiny target: every stage runs, the table and one JSON line come
out, and a second run resumes instead of redoing the work."""

import json
import os
import subprocess
import sys

from specdec.precision import compute_dtype, dtype_name

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ARGS = ["--target", "tiny-llama", "--prompts", "6", "--max-new-tokens", "12", "--epochs", "1",
        "--draft-vocab-size", "64", "--eval-prompts", "2", "--eval-max-new-tokens", "8", "--json"]


def test_quickstart_runs_and_resumes(tmp_path):
    out = tmp_path / "qs"
    r = subprocess.run([sys.executable, "-m", "specdec", "quickstart", "--out", str(out), *ARGS],
                       capture_output=True, text=True, env=ENV, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("mean_acceptance_length", "per_position_acceptance", "tokens_per_s", "plain_tokens_per_s", "speedup"):
        assert key in line
    assert len(line["per_position_acceptance"]) == 5 and line["mean_acceptance_length"] >= 1.0
    assert line["tree"]["depth"] == 5 and 1.0 <= line["tree"]["mean_acceptance_length"] <= 6.0
    # MT-Bench's categories: one row each for the questions evaluated, in the JSON line
    assert sum(row["num_prompts"] for row in line["per_category"]) == line["questions"]
    assert "by category" in r.stderr and all(row["category"] in r.stderr for row in line["per_category"])
    # On a CPU the tree runs on the first half of the questions evaluated (rounded up).
    assert line["tree"]["questions"] == (line["questions"] + 1) // 2
    assert (out / "train" / "drafter" / "config.json").exists()
    # --dtype auto: bf16 where this CPU multiplies bf16 natively, else fp32 (specdec.precision)
    assert line["dtype"] == dtype_name(compute_dtype("cpu"))
    assert line["engine"] == "reference"  # a tiny target: compiling the CPU fast path would not pay
    # The best k at the measured draft cost: k = 5 is among the candidates and, at the fitted cost,
    # predicts the measured speedup (at most the acceptance length: the cost is clipped at 0), so
    # the best can be no worse than that or than k = 0.
    best = line["best_k"]
    assert 0 <= best["k"] <= 5 and best["cost_ratio"] >= 0 and best["round_cost"] >= 0
    assert best["predicted_speedup"] >= 1.0 - 1e-9  # k = 0 (plain decoding) is 1.0
    assert {"1", "5"} <= set(best["measured"]) and best["measured"]["5"]["speedup"] == line["speedup"]
    # ...and then measured: at k = 5 the run's own speedup, at another k a run of its own, and
    # nothing at k = 0 (plain decoding is the baseline).
    if best["k"] == 5:
        assert best["measured_speedup"] == line["speedup"]
    elif best["k"] > 0:
        assert best["measured_speedup"] > 0 and 1.0 <= best["mean_acceptance_length"] <= best["k"] + 1
        assert f"k={best['k']}: measured speedup" in r.stderr
    else:
        assert "measured_speedup" not in best
    assert best["serve_k"] in (0, *map(int, best["measured"])) and ("serve with" in r.stderr)
    # Training's held-out figure as the engine would step through those answers, beside it.
    assert 1.0 <= line["heldout"]["walked_acceptance_length_k5"] <= 6.0
    assert "held-out training answers" in r.stderr
    # Every sampled question is either evaluated or reported as skipped (longer than the context).
    assert line["questions"] >= 1 and line["questions"] + line["questions_skipped"] == 2
    assert ("exceed the context" in r.stderr) == (line["questions_skipped"] > 0)
    regen = (out / "regen.jsonl").read_text().splitlines()
    again = subprocess.run([sys.executable, "-m", "specdec", "quickstart", "--out", str(out), *ARGS],
                           capture_output=True, text=True, env=ENV, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already trained" in again.stderr
    assert (out / "regen.jsonl").read_text().splitlines() == regen  # nothing regenerated twice


def test_quickstart_online_trains_without_a_capture_on_disk(tmp_path):
    """--online and --fused-loss (the GPU's defaults): the states are computed inside training, so
    no capture directory is written, the loss runs as the Triton kernels (here under Triton's
    interpreter, which conftest turns on without a GPU), and the drafter still trains, is
    evaluated and resumes."""
    from specdec.train import fused_loss

    out = tmp_path / "qs"
    args = [sys.executable, "-m", "specdec", "quickstart", "--out", str(out), *ARGS, "--online", "--fused-loss",
            "--tree-depth", "0"]
    r = subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["online"] is True and "online, inside training" in r.stderr
    assert not (out / "capture").exists() and (out / "train" / "drafter" / "config.json").exists()
    assert fused_loss.available("cpu")  # Triton is a dependency where the suite runs (pyproject.toml)
    assert json.loads((out / "train" / "train_summary.json").read_text())["fused_loss"] is True
    assert line["mean_acceptance_length"] >= 1.0 and 1.0 <= line["heldout"]["walked_acceptance_length_k5"] <= 6.0
    again = subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=900)
    assert again.returncode == 0 and "already trained" in again.stderr, again.stderr[-3000:]


def test_cpu_without_native_bf16_gets_smaller_defaults_unless_told():
    """fp32 CPUs run every stage ~1.7x slower; their defaults keep the run under 20 minutes, but a
    size given on the command line always wins."""
    import argparse

    from specdec.commands.quickstart import CPU, CPU_FP32, GPU, register, settings

    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    plain = p.parse_args(["quickstart"])
    assert settings(plain, cuda=False, fp32=False) == CPU
    fp32 = settings(plain, cuda=False, fp32=True)
    assert fp32["prompts"] < CPU["prompts"] and fp32["eval_prompts"] < CPU["eval_prompts"]
    assert {k: v for k, v in fp32.items() if k not in CPU_FP32} == {k: v for k, v in CPU.items() if k not in CPU_FP32}
    assert settings(plain, cuda=True, fp32=True) == GPU
    # Online on the GPU, a capture on disk on a CPU, unless told.
    assert GPU["online"] and not CPU["online"]
    assert not settings(p.parse_args(["quickstart", "--no-online"]), cuda=True, fp32=False)["online"]
    assert settings(p.parse_args(["quickstart", "--online"]), cuda=False, fp32=False)["online"]
    # The fused loss likewise: its kernels need CUDA.
    assert GPU["fused_loss"] and not CPU["fused_loss"]
    assert not settings(p.parse_args(["quickstart", "--no-fused-loss"]), cuda=True, fp32=False)["fused_loss"]
    told = settings(p.parse_args(["quickstart", "--prompts", "500", "--epochs", "2"]), cuda=False, fp32=True)
    assert told["prompts"] == 500 and told["epochs"] == 2 and told["eval_prompts"] == CPU_FP32["eval_prompts"]
    # --large: more prompts for fewer epochs, more training in all; options still override it.
    large = settings(p.parse_args(["quickstart", "--large"]), cuda=True, fp32=False)
    assert large["prompts"] > GPU["prompts"] and large["self_prompts"] > GPU["self_prompts"]
    assert large["epochs"] < GPU["epochs"]
    assert ((large["prompts"] + large["self_prompts"]) * large["epochs"]
            > 2 * (GPU["prompts"] + GPU["self_prompts"]) * GPU["epochs"])
    assert {k: v for k, v in large.items() if k not in ("prompts", "self_prompts", "epochs")} == {
        k: v for k, v in GPU.items() if k not in ("prompts", "self_prompts", "epochs")}
    assert settings(p.parse_args(["quickstart", "--large", "--epochs", "2"]), cuda=True, fp32=False)["epochs"] == 2


def test_large_preset_without_a_gpu_is_refused_before_anything_is_written(tmp_path):
    """--large is sized for a GPU; on a CPU it would run for days, so it stops at once, says why and
    what to do, with the usage exit code, and leaves no run directory behind."""
    out = tmp_path / "qs"
    r = subprocess.run([sys.executable, "-m", "specdec", "quickstart", "--large", "--out", str(out)],
                       capture_output=True, text=True, env=dict(ENV, CUDA_VISIBLE_DEVICES=""), timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--large" in r.stderr and "CUDA" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_best_k_from_two_measured_chains_then_measured_itself():
    """The quickstart measures a chain of 1 next to its chain of k = 5, fits a step's cost as
    1 + f + j c plain steps from the two, predicts the best j from the k = 5 run's curve at that
    cost, measures it where it is neither (on a subset of the prompts, against plain decoding on
    the same ones), and serves the fastest measured, or nothing where none beat plain."""
    from specdec.commands.quickstart import best_k_measured
    from specdec.diagnose.theory import speedup

    runs = []
    rates = {}  # j -> (tok/s, acceptance length) a chain of j measures
    plain = {"tok_s": 100.0}  # plain decoding beside each measured chain (on prompt "a")

    def measure(j):
        runs.append(j)
        tok_s, al = rates.get(j, (87.0, 1.5))
        return {"tokens_per_s": tok_s, "speedup": tok_s / plain["tok_s"], "mean_acceptance_length": al,
                "per_prompt": [{"id": "a"}]}

    per_prompt = [{"id": "a"}, {"id": "b"}]
    # A drafter that gets only its first token right: k = 5 at 0.8x, k = 1 at 0.87x; the fit puts
    # most of the cost in every step (f), so nothing is predicted to pay.
    weak = {"speedup": 0.8, "mean_acceptance_length": 1.55, "per_prompt": per_prompt,
            "per_position_acceptance": [0.5, 0.03, 0.01, 0.005, 0.005]}
    best = best_k_measured(weak, 5, measure)
    assert runs == [1] and best["k"] == 0 and best["predicted_speedup"] == 1.0 and best["serve_k"] == 0
    assert best["measured"]["1"] == {"speedup": 0.87, "mean_acceptance_length": 1.5, "questions": 1}
    assert best["measured"]["5"]["speedup"] == 0.8 and "measured_speedup" not in best
    # The fit reproduces both measured chains: 1 + f + j c = tokens per step / speedup.
    f, c = best["round_cost"], best["cost_ratio"]
    assert f > 0.5 and c > 0
    assert abs(speedup(1.5, 1, c, f) - 0.87) < 1e-9 and abs(speedup(1.55, 5, c, f) - 0.8) < 1e-9
    runs.clear()
    plain["tok_s"] = 50.0  # plain at 50 tok/s beside it: k = 1 measures 1.74x
    best = best_k_measured(weak, 5, measure)
    assert runs == [1] and best["k"] == 1 and best["measured_speedup"] == 1.74 and best["serve_k"] == 1
    runs.clear()
    plain["tok_s"] = 100.0
    # A better drafter: the fit predicts k = 3 (1.68x), which is then measured, and served.
    good = {"speedup": 1.5, "mean_acceptance_length": 3.35, "per_prompt": per_prompt,
            "per_position_acceptance": [0.9, 0.7, 0.5, 0.2, 0.05]}
    rates.update({1: (130.0, 1.9), 3: (170.0, 3.0)})
    best = best_k_measured(good, 5, measure)
    assert runs == [1, 3] and best["k"] == 3 and 1.6 < best["predicted_speedup"] < 1.75
    assert best["measured_speedup"] == 1.7 and best["questions"] == 1 and best["serve_k"] == 3
    assert sorted(best["measured"]) == ["1", "3", "5"]
    assert best_k_measured({"speedup": None}, 5, measure) is None
