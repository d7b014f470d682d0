"""`run_bench` reports each row's figure as soon as the row is timed, so a benchmark cut short
(a time limit, a crash in a later row) still leaves every figure it measured in its log."""

from specdec.bench.runs import run_bench
from tests.test_engine_lossless import random_drafter


def test_each_row_is_reported_when_measured(tiny_targets):
    target = tiny_targets["llama"]
    lines: list[str] = []
    result = run_bench(target, [[5, 6, 7, 8, 9]], max_new_tokens=6, drafter=random_drafter(target), ks=(2,),
                       fast=False, hf=False, progress=lines.append)
    methods = [r["method"] for r in result["rows"]]
    assert methods == ["specdec-plain", "specdec-ngram", "specdec-eagle3-k2"]
    for m, row in zip(methods, result["rows"]):
        report = next(i for i, line in enumerate(lines) if line.startswith(f"{m}: "))
        assert f"{row['tok_s']:.1f} tok/s" in lines[report]
        later = methods[methods.index(m) + 1 :]
        if later:  # reported before the next row starts
            assert report < lines.index(later[0])
