"""Parsing /metrics text and taking counter deltas: names, label sets, _created, resets."""

from pathlib import Path

import pytest

from specdec.diagnose import metrics as m
from specdec.diagnose.acceptance import INDEPENDENT, PREFIX, summarize
from specdec.errors import SpecdecError

FIX = Path(__file__).parent / "fixtures" / "metrics"
LLAMA = (("engine", "0"), ("model_name", "meta-llama/Llama-3.1-8B-Instruct"))
ACME = (("engine", "0"), ("model_name", "acme/support-8b"))


def load(name):
    return m.parse_metrics((FIX / name).read_text(), source=name)


def test_vllm_two_label_sets_exact_names():
    s = load("vllm_v1_two_models.txt")
    assert s.engine == "vllm"
    assert set(s.spec) == {LLAMA, ACME}
    llama = s.spec[LLAMA]
    # accepted must not absorb accepted_tokens_per_pos (a substring) nor the _created timestamps.
    assert llama.num_accepted_tokens == 18000
    assert llama.num_drafts == 10000
    assert llama.num_draft_tokens == 30000
    assert llama.accepted_per_pos == {0: 7800, 1: 5900, 2: 4300}
    assert 1e9 < llama.created < 3e9  # a timestamp, kept apart from the counts
    assert s.spec[ACME].accepted_per_pos[4] == 3
    assert s.generation_tokens[LLAMA] == 131000  # vllm:generation_tokens_total, not _created


def test_per_label_set_and_aggregate_figures():
    overall, parts = summarize(load("vllm_v1_two_models.txt"))
    by = {p.labels: p for p in parts}
    llama, acme = by[LLAMA], by[ACME]
    assert llama.counting == PREFIX
    assert llama.acceptance_rate == pytest.approx(0.6)
    assert llama.mean_acceptance_length == pytest.approx(2.8)
    assert llama.k == 3 and llama.k_source == "per-position series"
    assert llama.per_position == pytest.approx([0.78, 0.59, 0.43])
    assert llama.per_position_conditional == pytest.approx([0.78, 5900 / 7800, 4300 / 5900])
    assert acme.k == 5
    assert acme.mean_acceptance_length == pytest.approx(1 + 433 / 2000)
    # Aggregate sums counters; per-position positions differ (k 3 vs 5) so they are not mixed.
    assert overall.num_drafts == 12000
    assert overall.acceptance_rate == pytest.approx(18433 / 40000)
    assert overall.per_position is None
    assert any("different k" in n for n in overall.notes)


def test_missing_per_position_infers_k_from_draft_tokens():
    overall, parts = summarize(load("vllm_v1_no_per_pos.txt"))
    assert len(parts) == 1
    assert overall.per_position is None and overall.per_position_conditional is None
    assert overall.k == 4 and overall.k_source == "draft_tokens / drafts"
    assert overall.acceptance_rate == pytest.approx(0.375)
    assert overall.mean_acceptance_length == pytest.approx(2.5)
    assert overall.curve_source == "i.i.d. estimate"
    assert 1 + sum(overall.curve) == pytest.approx(2.5)  # the fit reproduces the measured mean


def test_two_counters_need_k_and_read_as_per_position_rate():
    s = load("seed_two_counters.txt")
    overall, _ = summarize(s)
    assert overall.counting == INDEPENDENT and overall.k is None
    overall, _ = summarize(s, k=5)
    assert overall.acceptance_rate == pytest.approx(0.1556, abs=1e-4)
    assert overall.mean_acceptance_length == pytest.approx(1.1843, abs=1e-3)
    assert overall.num_drafts == pytest.approx(7190 / 5)


def test_sglang_gauges():
    s = load("sglang.txt")
    assert s.engine == "sglang"
    overall, parts = summarize(s)
    assert overall.mean_acceptance_length == pytest.approx(3.2)
    # tree size = 3.2 / 0.5333 = 6 -> k = 5; draft-only acceptance = (3.2 - 1) / 5
    assert overall.k == 5
    assert overall.acceptance_rate == pytest.approx(0.44)
    assert overall.per_position is None
    assert 1 + sum(overall.curve) == pytest.approx(3.2)
    assert s.gen_throughput_gauge == pytest.approx(412.37)


def test_specdec_server_is_named():
    s = load("specdec_server.txt")
    assert s.engine == "specdec"
    overall, _ = summarize(s)
    assert overall.mean_acceptance_length == pytest.approx(3.0)


def test_no_spec_and_garbage():
    s = load("vllm_no_spec.txt")
    assert not s.has_spec
    with pytest.raises(SpecdecError, match="no speculative-decoding metrics found in vllm_no_spec.txt"):
        m.require_spec(s)
    with pytest.raises(SpecdecError, match="could not parse garbage.txt as Prometheus text"):
        load("garbage.txt")
    with pytest.raises(SpecdecError, match="holds HTML"):
        m.parse_metrics("<!doctype html><html><body>vLLM</body></html>", source="page")


def vllm_text(drafts, draft_tokens, accepted, per_pos, created=1.7e9, gen=None):
    lines = [
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
        f'vllm:spec_decode_num_drafts_created{{engine="0",model_name="m"}} {created}',
        f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft_tokens}',
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}',
    ]
    for i, v in enumerate(per_pos):
        lines.append(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {v}'
        )
    if gen is not None:
        lines.append(f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {gen}')
    return "\n".join(lines) + "\n"


def test_delta_subtracts_counters():
    a = m.parse_metrics(vllm_text(100, 300, 150, [70, 50, 30], gen=1000))
    b = m.parse_metrics(vllm_text(300, 900, 350, [170, 110, 70], gen=1600))
    d = m.delta(a, b)
    s = next(iter(d.spec.values()))
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (200, 600, 200)
    assert s.accepted_per_pos == {0: 100, 1: 60, 2: 40}
    assert not s.reset
    assert d.total_generation_tokens == 600
    overall, _ = summarize(d)
    assert overall.mean_acceptance_length == pytest.approx(2.0)
    assert overall.per_position == pytest.approx([0.5, 0.3, 0.2])


def test_delta_counter_reset_uses_second_value():
    a = m.parse_metrics(vllm_text(5000, 15000, 9000, [4000, 3000, 2000]))
    b = m.parse_metrics(vllm_text(40, 120, 60, [30, 20, 10]))  # restarted: went backwards
    s = next(iter(m.delta(a, b).spec.values()))
    assert s.reset
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (40, 120, 60)
    assert s.accepted_per_pos == {0: 30, 1: 20, 2: 10}
    overall, _ = summarize(m.delta(a, b))
    assert overall.mean_acceptance_length == pytest.approx(2.5)
    assert any("restart" in n for n in overall.notes)


def test_delta_reset_detected_by_created_even_when_counts_grew():
    # Restarted and already past the old values: only _created tells.
    a = m.parse_metrics(vllm_text(100, 300, 150, [70, 50, 30], created=1.7e9))
    b = m.parse_metrics(vllm_text(400, 1200, 600, [300, 200, 100], created=1.7e9 + 60))
    s = next(iter(m.delta(a, b).spec.values()))
    assert s.reset and s.num_drafts == 400


def test_label_set_appearing_between_scrapes_counts_in_full():
    a = m.parse_metrics("")
    b = m.parse_metrics(vllm_text(10, 30, 15, [7, 5, 3]))
    s = next(iter(m.delta(a, b).spec.values()))
    assert s.num_drafts == 10


def test_metrics_url_and_base_url():
    assert m.metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert m.metrics_url("http://h:8000/") == "http://h:8000/metrics"
    assert m.metrics_url("http://h:8000/metrics") == "http://h:8000/metrics"
    assert m.base_url("http://h:30000/metrics") == "http://h:30000"


def test_specdec_build_info_states_k():
    s = load("specdec_server.txt")
    assert s.k_hint == 4
    overall, _ = summarize(s)
    assert overall.k == 4 and overall.k_source == "specdec:build_info"


def test_lazily_created_per_position_series_do_not_shrink_k():
    # Positions 3-4 never accepted and never created; draft_tokens / drafts still says k = 5.
    text = vllm_text(100, 500, 60, [40, 15, 5])
    overall, _ = summarize(m.parse_metrics(text))
    assert overall.k == 5 and overall.k_source == "draft_tokens / drafts"
    assert overall.per_position == pytest.approx([0.4, 0.15, 0.05, 0.0, 0.0])
    assert overall.mean_acceptance_length == pytest.approx(1.6)


def test_specdec_server_metrics_read_back():
    """specdec's own /metrics (server.metrics) and diagnose agree on names and meaning."""
    server_metrics = pytest.importorskip("specdec.server.metrics")
    from specdec.engine.api import StepOutput

    sm = server_metrics.ServerMetrics("tiny-llama", positions=3, mode="chain", k=3, version="test")
    steps = [[True, True, False], [True, False, False], [False, False, False], [True, True, True]]
    for acc in steps:
        n = next((i for i, ok in enumerate(acc) if not ok), len(acc))  # accepted prefix length
        sm.observe_step(StepOutput(token_ids=list(range(n + 1)), drafted=3, accepted=n, accepted_positions=acc))
    body, _ = sm.render()
    s = m.parse_metrics(body.decode(), source="specdec serve")
    assert s.engine == "specdec"
    overall, _ = summarize(s)
    assert overall.num_drafts == 4 and overall.k == 3
    assert overall.num_accepted_tokens == 2 + 1 + 0 + 3
    assert overall.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert overall.per_position == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert s.total_generation_tokens == 3 + 2 + 1 + 4
