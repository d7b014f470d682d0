"""diagnose and watch against a real local HTTP server whose counters change between scrapes."""

import io
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from rich.console import Console

from specdec.cli import main
from specdec.diagnose.watch import watch
from specdec.errors import SpecdecError

LABELS = ["model_name", "engine"]


class FakeVllm:
    """One vLLM v1 server's registry: pages as prometheus_client renders them (HELP/TYPE,
    `_total`, and `_created` timestamps that stay fixed for the server's lifetime)."""

    def __init__(self, models=("meta-llama/Llama-3.1-8B-Instruct",)):
        r = self.registry = CollectorRegistry()
        self.models = models
        self.counters = {
            "drafts": Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", LABELS, registry=r),
            "draft_tokens": Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", LABELS, registry=r),
            "accepted": Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", LABELS,
                                registry=r),
            "gen": Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=r),
        }
        self.per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            LABELS + ["position"],
            registry=r,
        )
        self.values = {}

    def page(self, drafts, draft_tokens, accepted, per_pos, gen):
        """Advance every label set's counters to these totals and render /metrics."""
        new = {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted, "gen": gen}
        new.update({("pos", i): v for i, v in enumerate(per_pos)})
        for model in self.models:
            lv = (model, "0")
            for key, v in new.items():
                inc = v - self.values.get(key, 0)
                if isinstance(key, tuple):
                    self.per_pos.labels(*lv, str(key[1])).inc(inc)
                else:
                    self.counters[key].labels(*lv).inc(inc)
        self.values = new
        return generate_latest(self.registry).decode()


def vllm_pages(*totals, models=("meta-llama/Llama-3.1-8B-Instruct",)):
    server = FakeVllm(models)
    return [server.page(*t) for t in totals]


class MetricsServer:
    """Serves `pages` in order on /metrics (the last one repeats) and `server_info` as JSON."""

    def __init__(self, pages, server_info=None):
        self.pages = list(pages)
        self.server_info = server_info
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/metrics":
                    body = outer.pages[min(outer.hits, len(outer.pages) - 1)].encode()
                    outer.hits += 1
                    ctype = "text/plain; version=0.0.4; charset=utf-8"
                elif self.path == "/get_server_info" and outer.server_info is not None:
                    body, ctype = json.dumps(outer.server_info).encode(), "application/json"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def diagnose_json(capsys, url, *extra):
    rc = main(["diagnose", url, "--window", "0.2", "--json", *extra])
    captured = capsys.readouterr()
    assert rc == (1 if json.loads(captured.out)["verdict"] in ("speculation loses", "acceptance far below reference")
                  else 0), captured.err
    return json.loads(captured.out)


def test_url_window_uses_counter_deltas(capsys):
    before, after = vllm_pages(
        (10_000, 30_000, 20_000, [8_000, 7_000, 5_000], 100_000),
        (10_400, 31_200, 20_200, [8_100, 7_060, 5_040], 101_000),
    )
    with MetricsServer([before, after]) as srv:
        r = diagnose_json(capsys, srv.url + "/metrics")
        assert srv.hits == 2
    assert r["basis"] == "window"
    assert r["window_s"] == pytest.approx(0.2, abs=0.15)
    # Window: 400 drafts, 1200 draft tokens, 200 accepted -- not the lifetime 66.7%.
    assert r["num_drafts"] == 400
    assert r["acceptance_rate"] == pytest.approx(200 / 1200)
    assert r["mean_acceptance_length"] == pytest.approx(1.5)
    assert r["per_position_acceptance"] == pytest.approx([0.25, 0.15, 0.1])
    assert r["per_position_conditional"] == pytest.approx([0.25, 0.6, 40 / 60])
    assert r["throughput_tokens_per_s"] == pytest.approx(1000 / r["window_s"])
    tot = r["totals_since_start"]
    assert tot["num_drafts"] == 10_400 and tot["acceptance_rate"] == pytest.approx(20_200 / 31_200)


def test_url_counter_reset_between_scrapes(capsys):
    (before,) = vllm_pages((50_000, 150_000, 90_000, [40_000, 30_000, 20_000], 500_000))
    (after,) = vllm_pages((100, 300, 150, [70, 50, 30], 400))  # server restarted
    with MetricsServer([before, after]) as srv:
        r = diagnose_json(capsys, srv.url)  # base URL: /metrics is appended
    assert r["num_drafts"] == 100
    assert r["mean_acceptance_length"] == pytest.approx(2.5)
    assert r["counter_reset"] is True
    assert any("restart" in x for x in r["reasons"])
    assert r["throughput_tokens_per_s"] == pytest.approx(400 / r["window_s"])


def test_url_two_models_in_one_scrape(capsys):
    models = ("model-a", "model-b")
    before, after = vllm_pages(
        (100, 300, 150, [70, 50, 30], 0), (300, 900, 450, [210, 150, 90], 0), models=models
    )
    with MetricsServer([before, after]) as srv:
        r = diagnose_json(capsys, srv.url + "/metrics")
    assert [b["labels"]["model_name"] for b in r["per_label_set"]] == ["model-a", "model-b"]
    assert all(b["num_drafts"] == 200 for b in r["per_label_set"])
    assert r["num_drafts"] == 400
    assert r["per_position_acceptance"] == pytest.approx([0.7, 0.5, 0.3])  # same k: summed


def test_idle_window_falls_back_to_totals(capsys):
    (page,) = vllm_pages((1_000, 3_000, 1_500, [700, 500, 300], 9_000))
    with MetricsServer([page]) as srv:
        r = diagnose_json(capsys, srv.url + "/metrics")
    assert r["basis"].startswith("totals since start")
    assert r["num_drafts"] == 1_000
    assert any("no drafts during" in x for x in r["reasons"])


def test_sglang_url_reads_server_info(capsys):
    page = open(__file__.replace("test_diagnose_http.py", "fixtures/metrics/sglang.txt")).read()
    info = {"internal_states": [{"avg_spec_accept_length": 2.9, "last_gen_throughput": 400.0}]}
    with MetricsServer([page], server_info=info) as srv:
        r = diagnose_json(capsys, srv.url + "/metrics")
    assert r["engine"] == "sglang"
    assert r["basis"].startswith("latest SGLang log interval")
    assert r["mean_acceptance_length"] == pytest.approx(3.2)
    assert r["totals_since_start"]["mean_acceptance_length"] == pytest.approx(2.9)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_url(capsys):
    url = f"http://127.0.0.1:{free_port()}/metrics"
    assert main(["diagnose", url, "--window", "0"]) == 2
    err = capsys.readouterr().err
    assert "could not reach" in err and url in err
    assert len(err.strip().splitlines()) == 1


def test_http_404(capsys):
    with MetricsServer(["unused"]) as srv:
        assert main(["diagnose", srv.url + "/nope", "--window", "0"]) == 2
    assert "HTTP 404" in capsys.readouterr().err


def test_watch_once_renders_one_frame(capsys, tmp_path):
    before, after = vllm_pages(
        (10_000, 30_000, 20_000, [8_000, 7_000, 5_000], 100_000),
        (10_400, 31_200, 20_200, [8_100, 7_060, 5_040], 101_000),
    )
    rec = tmp_path / "watch.jsonl"
    with MetricsServer([before, after]) as srv:
        rc = main(["watch", srv.url + "/metrics", "--once", "--interval", "0.2", "--record", str(rec)])
        assert srv.hits == 2
    out = capsys.readouterr().out
    assert rc == 0
    assert "specdec watch" in out
    assert "16.7%" in out  # windowed acceptance 200/1200, not the lifetime 66.7%
    assert "25.0%" in out and "█" in out  # position-0 bar
    assert "tok/s" in out
    frames = [json.loads(line) for line in rec.read_text().splitlines()]
    assert len(frames) == 1
    assert frames[0]["acceptance_rate"] == pytest.approx(200 / 1200)
    assert frames[0]["tokens_per_s"] == pytest.approx(1000 / frames[0]["window_s"])


def test_watch_live_loop_exits_cleanly_on_ctrl_c():
    pages = vllm_pages(*[(100 * i, 300 * i, 150 * i, [70 * i, 50 * i, 30 * i], 1000 * i) for i in range(1, 6)])
    calls = {"n": 0}

    def sleep(_):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    buf = io.StringIO()
    with MetricsServer(pages) as srv:
        rc = watch(srv.url + "/metrics", interval=0.01, console=Console(file=buf, width=100), sleep=sleep)
    assert rc == 0
    assert "stopped" in buf.getvalue()
    assert "50.0%" in buf.getvalue()  # acceptance 150/300 per window


def test_watch_needs_a_url():
    with pytest.raises(SpecdecError, match="not a URL"):
        watch("metrics.txt", once=True)
