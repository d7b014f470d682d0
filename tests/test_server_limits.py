"""`specdec serve` under abuse: bad input never reaches a 5xx or a dropped connection, a full queue
answers 429 with Retry-After and loses nothing, a wait past the queue timeout is a 503 that never
ran, SIGTERM drains, and schemathesis holds every endpoint to the server's own OpenAPI schema.
Real server processes on localhost (tiny llama), raw httpx."""

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from specdec.server.launch import ServerProcess

ENV = {"OMP_NUM_THREADS": "1"}
MODEL = "tiny"


def serve(tiny_dirs, *extra):
    return ServerProcess(["--target", str(tiny_dirs["llama"]), "--served-model-name", MODEL, "--max-model-len", "96",
                          *extra], env=ENV)


@pytest.fixture(scope="module")
def server(tiny_dirs):
    with serve(tiny_dirs, "--ngram", "3") as proc:
        yield proc


LONG = ("--max-model-len", "512")  # room for a request that holds the worker for about a second


def long_request(**kw):
    """A request that holds the worker for about a second (greedy, EOS ignored), on a server with LONG."""
    return {"model": MODEL, "prompt": "hold", "max_tokens": 500, "temperature": 0, "ignore_eos": True, **kw}


def metric(url: str, name: str, **labels) -> float:
    want = {"engine": "0", "model_name": MODEL, **labels}
    key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(want.items())) + "}"
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(key + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# Each found as a 500 or a reset connection before; now a 400 with OpenAI's error body.
CHAT = {"model": MODEL, "max_tokens": 4}
BAD = {
    "lone surrogate in a chat message": (
        "/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    "lone surrogate in a prompt": ("/v1/completions", '{"model": "tiny", "prompt": "\\udfff"}'),
    "5,000-digit max_tokens": ("/v1/completions", '{"model": "tiny", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}"),
    "5,000-digit seed": ("/v1/completions", '{"model": "tiny", "prompt": "x", "seed": ' + "9" * 5000 + "}"),
    "100,000-deep array": ("/v1/completions", '{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "seed of 2^64": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "seed": 2**64, "temperature": 1})),
    "role foo": ("/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "foo", "content": "hi"}]})),
    "user message without content": ("/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "user"}]})),
    "model null": ("/v1/completions", json.dumps({"model": None, "prompt": "x"})),
    "stop string of 5,000 characters": ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x",
                                                                       "stop": "s" * 5000})),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_400_and_the_connection_lives_on(server, case):
    path, body = BAD[case]
    with httpx.Client(base_url=server.url, timeout=30) as c:  # one kept-alive connection for both
        r = c.post(path, content=body.encode("utf-8", "surrogatepass"), headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


def test_top_p_that_rounds_to_zero_samples_the_top_token(server):
    """top_p = 1e-46 is 0 in float32: the nucleus keeps the most likely token (was NaN, a 500)."""
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 6, "temperature": 1.0, "top_p": 1e-46, "seed": 3}
    sampled = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    greedy = httpx.post(server.url + "/v1/completions", json={**body, "temperature": 0}, timeout=30)
    assert sampled.status_code == 200 and sampled.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_a_huge_prompt_is_refused_before_tokenizing_and_health_stays_up(server):
    prompt = "word " * 3_000_000  # 15 MB: far over 96 tokens x 64 characters
    seen = []

    def health():
        while not seen or seen[-1] is not None:
            t0 = time.perf_counter()
            httpx.get(server.url + "/health", timeout=30)
            seen.append(time.perf_counter() - t0)
            if len(seen) > 3:
                return

    t = threading.Thread(target=health)
    t.start()
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt}, timeout=60)
    t.join()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"]
    assert max(seen) < 5


def test_a_chunked_body_over_the_limit_is_refused(tiny_dirs):
    with serve(tiny_dirs, "--max-body-mb", "1") as srv:
        sent = [0]

        def body():
            for _ in range(64):  # 8 MiB in 128 KiB chunks, no Content-Length
                sent[0] += 1
                yield b" " * (128 << 10)

        r = httpx.post(srv.url + "/v1/completions", content=body(), headers={"Content-Type": "application/json"},
                       timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_burst_gets_429s_for_the_excess_and_200s_for_the_rest_none_lost(tiny_dirs):
    n = 300
    with serve(tiny_dirs, "--max-waiting", "4") as srv:
        async def burst():
            limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as c:
                body = {"model": MODEL, "prompt": "burst", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(n)))

        replies = asyncio.run(burst())
        codes = [r.status_code for r in replies]
        assert set(codes) == {200, 429} and len(codes) == n  # every request answered, none lost or 5xx
        ok = codes.count(200)
        assert 5 <= ok < n
        refused = [r for r in replies if r.status_code == 429]
        assert all(int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full" for r in refused)
        # The server counts exactly the ones it ran, and nothing is left waiting.
        assert metric(srv.url, "vllm:request_success_total", finished_reason="length") == ok
        assert metric(srv.url, "vllm:num_requests_waiting") == 0 == metric(srv.url, "vllm:num_requests_running")


def test_a_request_past_the_queue_timeout_is_a_503_that_never_ran(tiny_dirs):
    with serve(tiny_dirs, "--queue-timeout", "0.2", *LONG) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=long_request(stream=True)) as running:
                lines = running.iter_lines()
                assert next(lines).startswith("data: ")  # holds the worker
                prefilled = metric(srv.url, "vllm:prompt_tokens_total")
                late = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "late"}, timeout=60)
                assert late.status_code == 503 and late.json()["error"]["code"] == "queue_timeout"
            # Closing the stream cancels the running request; "late" never reached the engine.
            assert metric(srv.url, "vllm:prompt_tokens_total") == prefilled


def test_sigterm_drains(tiny_dirs):
    """SIGTERM with one stream running and three requests waiting: the waiting get a 503 at once,
    the stream ends with [DONE], nothing gets a bare 'Internal Server Error', the process exits."""
    srv = serve(tiny_dirs, "--drain-timeout", "1", *LONG)
    with srv:
        replies, stream_lines = [], []
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=long_request(stream=True)) as running:
                lines = running.iter_lines()
                assert next(lines).startswith("data: ")

                def wait():
                    replies.append(httpx.post(srv.url + "/v1/completions", json=long_request(), timeout=60))

                waiting = [threading.Thread(target=wait) for _ in range(3)]
                for t in waiting:
                    t.start()
                deadline = time.time() + 20
                while metric(srv.url, "vllm:num_requests_waiting") < 3 and time.time() < deadline:
                    time.sleep(0.05)
                srv.proc.send_signal(signal.SIGTERM)
                stream_lines = [ln for ln in lines if ln]
                for t in waiting:
                    t.join(30)
        # uvicorn re-raises the signal once it has shut down, so the status says how it was stopped.
        assert srv.proc.wait(30) == -signal.SIGTERM
    assert [r.status_code for r in replies] == [503] * 3
    assert all(r.json()["error"]["code"] == "shutting_down" for r in replies)
    assert stream_lines[-1] == "data: [DONE]"
    assert "Internal Server Error" not in srv.output


def test_every_endpoint_holds_to_its_openapi_schema(server):
    """schemathesis: bodies generated from /openapi.json (the request models), every endpoint, no
    5xx, and every response matching the schema (status, content type, body)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    failures, statuses = [], {}
    for result in schema.get_all_operations():
        op = result.ok()

        @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            if isinstance(case.body, dict):  # a random model name is a 404 before anything else is checked
                case.body["model"] = MODEL
            response = case.call(base_url=server.url, timeout=30)
            statuses.setdefault(op.label, []).append(response.status_code)
            try:
                case.validate_response(response, checks=checks)
            except Exception as e:  # collected, so one run reports every operation that fails
                failures.append(f"{op.label}: {type(e).__name__}: {str(e)[:300]}")

        run()
    assert not failures, "\n".join(failures[:10])
    assert len(statuses) == 5 and all(len(v) >= 20 for k, v in statuses.items() if k.startswith("POST"))


def test_protect_metrics_guards_metrics_and_the_schema_with_the_key(tiny_dirs):
    with serve(tiny_dirs, "--api-key", "k3y", "--protect-metrics") as srv:
        key = {"Authorization": "Bearer k3y"}
        for path in ("/metrics", "/openapi.json"):
            refused = httpx.get(srv.url + path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(srv.url + path, headers=key).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200  # load balancers probe it without a key


def test_protect_metrics_without_a_key_is_refused_before_loading(capsys):
    from specdec.cli import main

    assert main(["serve", "--target", "tiny-llama", "--protect-metrics"]) == 2
    assert "--api-key" in capsys.readouterr().err
