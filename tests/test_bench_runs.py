"""`run_bench` reports each row's figure as soon as the row is timed, so a benchmark cut short
(a time limit, a crash in a later row) still leaves every figure it measured in its log."""

from specdec.bench.runs import format_table, run_bench
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


def test_hf_assisted_row_is_lossless_against_plain(tiny_targets):
    # The target as its own assistant: HF assisted generation runs its full draft/verify loop and,
    # greedy, must give exactly the target's own tokens.
    target = tiny_targets["llama"]
    result = run_bench(target, [[5, 6, 7, 8, 9], [9, 8, 7]], max_new_tokens=8, fast=False, assistant=target)
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["hf-generate", "hf-prompt-lookup", "hf-assisted", "specdec-plain", "specdec-ngram"]
    assisted = rows["hf-assisted"]
    assert assisted["error"] is None and assisted["new_tokens"] > 0
    assert assisted["identical_to_plain"] == 2
    assert assisted["vs_hf_generate"] is not None


def test_speculative_rows_report_their_step_cost_and_draft_cost(tiny_targets):
    """Each speculative row's step cost is its ms per target pass over plain decoding's, and c its
    excess over one plain step per drafted token: the ratio `diagnose --cost-ratio` and the best k use."""
    target = tiny_targets["llama"]
    result = run_bench(target, [[5, 6, 7, 8, 9], [9, 8, 7]], max_new_tokens=8, drafter=random_drafter(target),
                       ks=(3,), fast=False, hf=False)
    rows = {r["method"]: r for r in result["rows"]}
    plain = rows["specdec-plain"]
    assert plain["steps"] == plain["new_tokens"] and plain["step_cost"] is None
    per_step = plain["seconds"] / plain["steps"]
    eagle = rows["specdec-eagle3-k3"]
    assert 0 < eagle["steps"] < eagle["new_tokens"] + 2 and 0 < eagle["drafted_per_step"] <= 3
    assert abs(eagle["step_cost"] - eagle["seconds"] / eagle["steps"] / per_step) < 1e-9
    assert abs(eagle["cost_per_draft"] - (eagle["step_cost"] - 1) / eagle["drafted_per_step"]) < 1e-9
    assert all(rows[m]["cost_per_draft"] is not None for m in ("specdec-ngram", "specdec-eagle3-k3")
               if rows[m]["drafted_per_step"])
    table = format_table(result)
    assert f"{eagle['cost_per_draft']:.2f}" in table.splitlines()[-1]
