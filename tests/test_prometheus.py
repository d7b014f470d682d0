"""A real Prometheus server scrapes `specdec serve` and computes the acceptance rate with the query
a vLLM dashboard uses; it must equal the server's own counters.

Needs the `prometheus` binary (Debian: `apt-get install prometheus`; .ci/run installs it).
"""

import os
import shutil
import socket
import subprocess
import time

import httpx
import openai
import pytest

from specdec.server.launch import ServerProcess

PROMETHEUS = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
QUERY = "sum(vllm:spec_decode_num_accepted_tokens_total)/sum(vllm:spec_decode_num_draft_tokens_total)"
MODEL = "tiny-prom"

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is not installed (apt-get install prometheus)",
)


@pytest.fixture(scope="module")
def server(tiny_dirs):
    proc = ServerProcess(["--target", str(tiny_dirs["llama"]), "--ngram", "3", "--served-model-name", MODEL],
                         env={"OMP_NUM_THREADS": "1"})
    with proc:
        yield proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: specdec\n"
        "    scrape_interval: 1s\n"
        "    scrape_timeout: 1s\n"
        "    metrics_path: /metrics\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    log = open(tmp / "prometheus.log", "w+")
    proc = None
    try:
        for _attempt in range(3):  # the chosen port can be taken before Prometheus binds it
            port = _free_port()
            proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/-/ready", timeout=2).status_code == 200:
                        yield url
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            _stop(proc)
        log.seek(0)
        pytest.fail(f"prometheus did not become ready:\n{log.read()[-3000:]}")
    finally:
        if proc is not None:
            _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _counter(text: str, name: str) -> float:
    key = f'{name}{{engine="0",model_name="{MODEL}"}} '
    line = next(line for line in text.splitlines() if line.startswith(key))
    return float(line.rsplit(" ", 1)[1])


def _query(url: str, q: str) -> float | None:
    r = httpx.get(url + "/api/v1/query", params={"query": q}, timeout=5).json()
    assert r["status"] == "success", r
    result = r["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def test_prometheus_acceptance_rate_equals_server_counters(server, prometheus):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = ["the cat sat on the mat. the cat sat on the mat. the cat",
               "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2", "abc abc abc abc abc abc"]
    for p in prompts:
        client.completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    accepted = _counter(text, "vllm:spec_decode_num_accepted_tokens_total")
    drafted = _counter(text, "vllm:spec_decode_num_draft_tokens_total")
    assert drafted > 0 and accepted > 0
    expected = accepted / drafted

    # Wait for a scrape taken after the last request (scrape_interval 1 s).
    deadline = time.monotonic() + 30
    got = None
    while time.monotonic() < deadline:
        got = _query(prometheus, QUERY)
        if got is not None and abs(got - expected) < 1e-12:
            break
        time.sleep(0.5)
    assert got == pytest.approx(expected, abs=1e-12), (got, expected)
    assert _query(prometheus, 'up{job="specdec"}') == 1.0
    assert _query(prometheus, "sum(vllm:spec_decode_num_draft_tokens_total)") == drafted
    # Per-position series arrive with their label, and position 0 bounds the others.
    pos0 = _query(prometheus, 'sum(vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"})')
    drafts = _query(prometheus, "sum(vllm:spec_decode_num_drafts_total)")
    assert 0 < pos0 <= drafts
