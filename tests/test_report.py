"""`specdec report`: index.html + PNGs from diagnose, eval, bench and watch outputs."""

import json
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.diagnose.report import acceptance_blocks, build_report, curve_of, load_input
from specdec.errors import SpecdecError

FIX = Path(__file__).parent / "fixtures" / "metrics"
PNG = b"\x89PNG\r\n\x1a\n"


def report(capsys, *args):
    rc = main(["report", *args])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    index = Path(captured.out.strip())
    assert index.name == "index.html" and index.exists()
    return index


def pngs(directory):
    files = sorted(p.name for p in Path(directory).glob("*.png"))
    for name in files:
        assert (Path(directory) / name).read_bytes().startswith(PNG)
    return files


def test_report_from_diagnose_json(tmp_path, capsys):
    assert main(["diagnose", str(FIX / "vllm_v1_two_models.txt"), "--json"]) == 0
    diag = tmp_path / "diag.json"
    diag.write_text(capsys.readouterr().out)
    index = report(capsys, str(diag), "-o", str(tmp_path / "out"))
    assert index == tmp_path / "out" / "index.html"
    # One speedup plot per block (aggregate + two label sets) and the per-position bars.
    assert pngs(tmp_path / "out") == ["per_position.png", "speedup_vs_k.png", "speedup_vs_k_1.png",
                                      "speedup_vs_k_2.png"]
    page = index.read_text()
    assert 'src="per_position.png"' in page and 'src="speedup_vs_k.png"' in page
    assert "acme/support-8b" in page and "speculation loses" in page
    assert "specdec doctor" in page
    assert not list((tmp_path / "out").glob(".*.tmp"))  # atomic writes leave no temporaries


def test_report_default_out_dir_and_missing_per_position(tmp_path, capsys):
    assert main(["diagnose", str(FIX / "seed_two_counters.txt"), "--k", "5", "--json"]) == 1
    diag = tmp_path / "seed.json"
    diag.write_text(capsys.readouterr().out)
    index = report(capsys, str(diag))
    assert index == tmp_path / "seed_report" / "index.html"
    assert pngs(tmp_path / "seed_report") == ["speedup_vs_k.png"]
    assert "per-position acceptance unavailable" in index.read_text()


def test_report_from_eval_json(tmp_path, capsys):
    data = {"per_position_acceptance": [0.7, 0.45, 0.3], "mean_acceptance_length": 2.45, "acceptance_rate": 0.483,
            "k": 3}
    src = tmp_path / "eval.json"
    src.write_text(json.dumps(data))
    index = report(capsys, str(src), "-o", str(tmp_path / "r"), "--cost-ratios", "0.05,0.3")
    assert pngs(tmp_path / "r") == ["per_position.png", "speedup_vs_k.png"]
    assert "2.45" in index.read_text()


def test_report_from_bench_json_with_table_then_json_line(tmp_path, capsys):
    bench = {"device": "cpu", "rows": [{"name": "plain", "tokens_per_s": 31.5},
                                       {"name": "eagle3 k=3", "tokens_per_s": 70.2, "speedup": 2.23}]}
    src = tmp_path / "bench.json"
    src.write_text("name        tok/s\nplain        31.5\n" + json.dumps(bench) + "\n")
    index = report(capsys, str(src), "-o", str(tmp_path / "b"))
    assert pngs(tmp_path / "b") == ["bench.png"]
    page = index.read_text()
    assert "eagle3 k=3" in page and "70.2" in page


def test_report_from_watch_record(tmp_path, capsys):
    frames = [
        {"t": 2.0 * i, "tokens_per_s": 100.0 + i, "acceptance_rate": 0.5, "source": "http://x/metrics",
         "engine": "vllm"}
        for i in range(5)
    ]
    src = tmp_path / "watch.jsonl"
    src.write_text("".join(json.dumps(f) + "\n" for f in frames) + '{"t": 10, "tokens_')  # torn last line
    assert len(load_input(src)["timeseries"]) == 5
    index = report(capsys, str(src), "-o", str(tmp_path / "w"))
    assert pngs(tmp_path / "w") == ["throughput.png"]
    assert "Throughput over time" in index.read_text()


def test_curve_of_prefers_measured_then_fits_the_mean():
    assert curve_of({"per_position_acceptance": [0.5, 0.2]}) == ([0.5, 0.2], "measured")
    curve, source = curve_of({"mean_acceptance_length": 2.0, "k": 2})
    assert source.startswith("i.i.d.") and 1 + sum(curve) == pytest.approx(2.0)
    assert curve_of({"acceptance_rate": 0.4}) is None


def test_nested_eval_results_are_found():
    data = {"mt_bench": {"mean_acceptance_length": 2.1, "k": 3}, "humaneval": {"mean_acceptance_length": 2.9, "k": 3}}
    assert [n for n, _ in acceptance_blocks(data)] == ["mt_bench", "humaneval"]


def test_report_rejects_unplottable_input(tmp_path, capsys):
    src = tmp_path / "x.json"
    src.write_text('{"hello": 1}')
    assert main(["report", str(src)]) == 2
    assert "nothing to plot" in capsys.readouterr().err
    with pytest.raises(SpecdecError, match="not JSON"):
        (tmp_path / "y.json").write_text("not json at all")
        build_report(load_input(tmp_path / "y.json"), tmp_path / "y")
