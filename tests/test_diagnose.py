"""`specdec diagnose` end to end on saved scrapes: numbers, verdicts, --json, errors."""

import io
import json
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.diagnose.core import diagnose

FIX = Path(__file__).parent / "fixtures" / "metrics"
REQUIRED = {
    "acceptance_rate", "mean_acceptance_length", "per_position_acceptance", "num_drafts", "k",
    "verdict", "recommended_k", "engine", "per_label_set", "totals_since_start", "reasons",
    "expected_tokens_per_pass", "predicted_speedup", "cost_ratio",
}


def run_json(capsys, *args, rc=0):
    got = main(["diagnose", *args, "--json"])
    out = capsys.readouterr().out
    assert got == rc
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, "--json prints exactly one JSON object"
    return json.loads(lines[0])


def test_seed_case(capsys):
    r = run_json(capsys, str(FIX / "seed_two_counters.txt"), "--k", "5", rc=1)
    assert REQUIRED <= set(r)
    assert r["acceptance_rate"] == pytest.approx(0.156, abs=5e-4)
    assert r["expected_tokens_per_pass"] == pytest.approx(1.18, abs=0.01)
    assert r["k"] == 5
    # Far below what EAGLE-3 drafters reach: a fault to find, whatever the cost ratio.
    assert r["verdict"] == "acceptance far below reference" and r["speed_verdict"] == "speculation loses"
    assert "published EAGLE-3" in r["headline"] and "doctor --server" in r["headline"]
    assert "any cost ratio above 0.037" in r["headline"]
    assert r["cost_ratio"] == 0.05 and r["cost_ratio_assumed"]
    assert r["break_even_cost_ratio"] == pytest.approx(0.037, abs=1e-3)
    assert r["predicted_speedup"] < 1
    assert r["recommended_k"] == 1
    text = " ".join(r["reasons"])
    assert "c > 0.037" in text and "E = 1.18" in text
    steps = " ".join(r["next_steps"])
    assert "lower k" in steps and "specdec doctor" in steps
    assert r["per_position_acceptance"] is None and r["per_position_available"] is False


def test_seed_case_loses_for_any_cost_ratio_above_004(capsys):
    for c in ("0.04", "0.1", "0.3"):
        r = run_json(capsys, str(FIX / "seed_two_counters.txt"), "--k", "5", "--cost-ratio", c, rc=1)
        assert r["speed_verdict"] == "speculation loses", c
        assert r["cost_ratio"] == float(c) and not r["cost_ratio_assumed"]
    r = run_json(capsys, str(FIX / "seed_two_counters.txt"), "--k", "5", "--cost-ratio", "0.02", rc=1)
    assert r["speed_verdict"] == "marginal" and r["verdict"] == "acceptance far below reference"


def test_seed_counts_with_num_drafts_are_prefix_counts(tmp_path):
    # The same two counters plus vLLM v1's num_drafts: accepted is a prefix count, E = 1 + 1119/1438.
    text = (FIX / "seed_two_counters.txt").read_text() + (
        '# TYPE vllm:spec_decode_num_drafts_total counter\n'
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="acme/support-8b"} 1438.0\n'
    )
    p = tmp_path / "v1.txt"
    p.write_text(text)
    r = diagnose(str(p))
    assert r["k"] == 5 and r["counting"] == "prefix"
    assert r["mean_acceptance_length"] == pytest.approx(1 + 1119 / 1438)
    assert r["break_even_cost_ratio"] == pytest.approx(1119 / 7190, abs=1e-3)
    # The motivating case: 1.42x at an assumed c = 0.05, yet far below any working EAGLE-3 drafter.
    assert r["speed_verdict"] == "healthy" and r["cost_ratio_assumed"]
    assert r["verdict"] == "acceptance far below reference"
    assert "speculation loses at any cost ratio above 0.156; run `specdec doctor --server`" in r["headline"]
    # Held against a drafter whose own reference is as low, it is no fault; the assumed c is said.
    from specdec.diagnose.verdict import Reference

    weak = diagnose(str(p), reference=Reference(1.85, 5, "a weak drafter"))
    assert weak["verdict"] == "healthy" and "pays only while c < 0.156" in weak["headline"]
    assert any("over plausible cost ratios" in x and "c = 0.2" in x for x in weak["reasons"])


def test_seed_without_k_explains_what_to_pass(capsys):
    rc = main(["diagnose", str(FIX / "seed_two_counters.txt")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "pass --k" in err and "num_drafts" in err
    assert len(err.strip().splitlines()) == 1


def test_two_models_per_label_set(capsys):
    r = run_json(capsys, str(FIX / "vllm_v1_two_models.txt"))
    sets = {b["labels"]["model_name"]: b for b in r["per_label_set"]}
    assert set(sets) == {"meta-llama/Llama-3.1-8B-Instruct", "acme/support-8b"}
    good, bad = sets["meta-llama/Llama-3.1-8B-Instruct"], sets["acme/support-8b"]
    assert good["verdict"] == "healthy"
    assert good["per_position_acceptance"] == pytest.approx([0.78, 0.59, 0.43])
    assert good["per_position_conditional"][1] == pytest.approx(5900 / 7800)
    assert bad["verdict"] == "acceptance far below reference" and bad["speed_verdict"] == "speculation loses"
    assert bad["position0_acceptance"] == pytest.approx(0.15) and not bad["position0_estimated"]
    assert any("specdec doctor" in s for s in bad["next_steps"])
    assert bad["recommended_k"] == 1
    # The aggregate must not hide the losing model.
    assert r["num_drafts"] == 12000
    assert any("acme/support-8b" in reason and "loses" in reason for reason in r["reasons"])
    assert r["totals_since_start"]["num_drafts"] == 12000


def test_healthy_drafter_recommends_its_best_k(capsys):
    r = run_json(capsys, str(FIX / "vllm_v1_two_models.txt"), "--cost-ratio", "0.3")
    good = next(b for b in r["per_label_set"] if "Llama" in b["labels"]["model_name"])
    # At c = 0.3, S(k) = E(k) / (1 + 0.3k) from the measured curve [0.78, 0.59, 0.43] peaks at k = 2.
    assert good["recommended_k"] == 2
    assert good["recommended_speedup"] == pytest.approx(2.37 / 1.6)
    assert not any("doctor" in s for s in good["next_steps"])


def test_missing_per_position(capsys):
    r = run_json(capsys, str(FIX / "vllm_v1_no_per_pos.txt"))
    assert r["per_position_acceptance"] is None and r["per_position_available"] is False
    assert r["k"] == 4 and r["k_source"] == "draft_tokens / drafts"
    assert r["mean_acceptance_length"] == pytest.approx(2.5)
    assert any("per-position acceptance unavailable" in x for x in r["reasons"])
    assert r["per_label_set"] == []


def test_sglang_file(capsys):
    r = run_json(capsys, str(FIX / "sglang.txt"))
    assert r["engine"] == "sglang"
    assert r["basis"].startswith("latest SGLang log interval")
    assert r["mean_acceptance_length"] == pytest.approx(3.2)
    assert r["expected_tokens_per_pass"] == pytest.approx(3.2)
    assert r["k"] == 5 and r["acceptance_rate"] == pytest.approx(0.44)
    assert r["predicted_speedup"] == pytest.approx(3.2 / 1.25)
    assert r["verdict"] == "healthy"


def test_stdin(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO((FIX / "specdec_server.txt").read_text()))
    r = run_json(capsys, "-")
    assert r["engine"] == "specdec" and r["source"] == "stdin"
    assert r["k"] == 4 and r["acceptance_rate"] == pytest.approx(0.5)


def test_pretty_output_names_the_verdict_and_actions(capsys):
    assert main(["diagnose", str(FIX / "seed_two_counters.txt"), "--k", "5"]) == 1
    out = capsys.readouterr().out
    assert "ACCEPTANCE FAR BELOW REFERENCE" in out and "0.037" in out
    assert "15.6%" in out and "1.18" in out
    assert "specdec doctor" in out


@pytest.mark.parametrize(
    "name, message",
    [
        ("vllm_no_spec.txt", "no speculative-decoding metrics found"),
        ("garbage.txt", "could not parse"),
        ("does_not_exist.txt", "does not exist"),
    ],
)
def test_errors_are_one_line(capsys, name, message):
    rc = main(["diagnose", str(FIX / name)])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_all_zero_counters_say_send_traffic(tmp_path, capsys):
    p = tmp_path / "zero.txt"
    p.write_text(
        'vllm:spec_decode_num_drafts_total{model_name="m"} 0.0\n'
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 0.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 0.0\n'
    )
    assert main(["diagnose", str(p)]) == 2
    assert "send traffic" in capsys.readouterr().err
