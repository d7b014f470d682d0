"""`specdec serve` end to end: a real server process (tiny llama, n-gram drafting), called with the
official `openai` client, raw httpx for bad input, curl for the /metrics acceptance check, and the
engine itself in-process to check that /metrics counts exactly what the engine did."""

import json
import re
import shlex
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from specdec.server.launch import ServerProcess

KEY = "test-key-123"
MODEL = "tiny"
REPETITIVE = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def server(tiny_dirs):
    # One intra-op thread: a tiny model gains nothing from more, and on a busy 2-core runner
    # OpenMP threads that spin against other processes make each step ~50x slower.
    proc = ServerProcess(["--target", str(tiny_dirs["llama"]), "--ngram", "3", "--num-speculative-tokens", "5",
                          "--api-key", KEY, "--served-model-name", MODEL], env={"OMP_NUM_THREADS": "1"})
    with proc:
        yield proc
    assert proc.proc.returncode is not None


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dirs["llama"])


def scrape(http) -> dict[str, float]:
    """Samples of /metrics by their full text key, e.g. 'vllm:x_total{engine="0",...}'."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def sample(samples: dict, name: str, **labels) -> float:
    labels = {"engine": "0", "model_name": MODEL, **labels}
    key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return samples.get(key, 0.0)


SPEC = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}


# -- basics ------------------------------------------------------------------------------------



def wait_for_abort(http, before):
    """The scrape once exactly one more request has finished as "abort" and none is running."""
    def aborted():
        now = scrape(http)
        done = sample(now, "vllm:request_success_total", finished_reason="abort") - sample(
            before, "vllm:request_success_total", finished_reason="abort")
        return now if done == 1 and sample(now, "vllm:num_requests_running") == 0 else None

    return wait_for(aborted, what="the abort to be counted")

def test_health_models_and_banner(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = server.output
    assert f"{server.url}/v1" in out
    assert f"specdec diagnose {server.url}/metrics" in out
    assert "curl -s " in out and f'"model": "{MODEL}"' in out


def test_chat_completion_and_usage(client, tokenizer):
    from specdec.data.chat import render_text

    messages = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    prompt = tokenizer(render_text(tokenizer, messages, add_generation_prompt=True), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt["input_ids"])
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # max_completion_tokens is the newer spelling of max_tokens.
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert r2.choices[0].message.content == choice.message.content


def test_chat_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count: 1 2 3"}], max_tokens=40,
              temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40 == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_streaming_and_not(client):
    kw = dict(model=MODEL, prompt=REPETITIVE, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    assert full.object == "text_completion"
    assert full.usage.completion_tokens == 30 and full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    # Without include_usage no chunk carries usage.
    plain = list(client.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in plain)


def test_default_max_tokens_of_completions_is_16(client):
    r = client.completions.create(model=MODEL, prompt="abc", temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_stop_strings(client):
    kw = dict(model=MODEL, prompt=REPETITIVE, max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    # A stop string taken from the middle of the greedy output: it must end the text right before
    # its first occurrence, and never appear itself.
    start = next(i for i in range(8, len(text) - 3) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    cut = text.find(stop)
    for stream in (False, True):
        r = client.completions.create(**kw, stop=[stop, "never-appears"], stream=stream)
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert reason == ["stop"]
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
            assert reason == "stop" and r.usage.completion_tokens < 60
        assert got == text[:cut], (stop, got, text)
    r = client.completions.create(**kw, stop=stop)  # a plain string works too
    assert r.choices[0].text == text[:cut]


def test_seed_reproducibility_at_temperature(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=32,
              temperature=0.9, top_p=0.95, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    b = client.chat.completions.create(**kw, seed=1234).choices[0].message.content
    c = client.chat.completions.create(**kw, seed=99).choices[0].message.content
    assert a == b
    assert a != c


# -- bad input -----------------------------------------------------------------------------------

BAD = [
    ("malformed json", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None),
    ("json array body", "/v1/completions", b"[1, 2]", 400, None),
    ("unknown model", "/v1/chat/completions",
     {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("wrong type", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("wrong type temperature", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ("messages not a list", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("zero max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("negative max_tokens", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400, "max_tokens"),
    ("oversized max_tokens", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("prompt + max_tokens over context", "/v1/completions",
     {"model": MODEL, "prompt": "x" * 400, "max_tokens": 200}, 400, "max_tokens"),
    ("prompt over context", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "y" * 600}]}, 400, "messages"),
    ("temperature out of range", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "temperature": 7}, 400, "temperature"),
    ("n > 1", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 3}, 400, "n"),
    ("token id outside vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
]


@pytest.mark.parametrize("what,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(http, what, path, body, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param
    if "context" in what or "oversized" in what:
        assert err["code"] == "context_length_exceeded"


def test_oversized_body_is_413(http):
    big = b'{"model": "tiny", "prompt": "' + b"x" * (33 << 20) + b'"}'
    r = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_api_key_is_required_on_v1_only(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_server_keeps_serving_after_bad_input(server, client):
    assert server.alive()
    r = client.completions.create(model=MODEL, prompt="still there?", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1


# -- cancellation and scheduling -----------------------------------------------------------------


def wait_for(pred, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_disconnecting_stream_cancels_its_request(server, http, client):
    before = scrape(http)
    # Sampling makes n-gram drafts miss, so 500 tokens take ~500 steps: seconds, not the 0.5 s a
    # greedy loop that n-gram lookup predicts perfectly would take.
    body = {"model": MODEL, "prompt": "go", "max_tokens": 500, "temperature": 1.0, "seed": 1, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        break
        # Leaving both blocks closes the connection mid-stream.

    after = wait_for_abort(http, before)
    generated = sample(after, "vllm:generation_tokens_total") - sample(before, "vllm:generation_tokens_total")
    assert 1 <= generated < 500, generated
    # The server keeps serving: the next request completes normally.
    r = client.completions.create(model=MODEL, prompt="next", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_disconnecting_non_streaming_client_cancels_its_request(server, http):
    before = scrape(http)
    body = {"model": MODEL, "prompt": "go", "max_tokens": 500, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(60, read=0.2))

    after = wait_for_abort(http, before)
    assert sample(after, "vllm:generation_tokens_total") - sample(before, "vllm:generation_tokens_total") < 500


def test_request_cancelled_while_waiting_never_runs(server, http):
    """FIFO: B waits behind A; B's client leaves; B is dropped without a prefill."""
    before = scrape(http)
    auth = {"Authorization": f"Bearer {KEY}"}
    a = {"model": MODEL, "prompt": "first", "max_tokens": 500, "temperature": 1.0, "seed": 1, "ignore_eos": True,
         "stream": True}
    b = {"model": MODEL, "prompt": "second in line", "max_tokens": 5, "temperature": 0}
    with httpx.Client(base_url=server.url, headers=auth, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=a) as r:
            lines = r.iter_lines()  # keep a reference: a collected iterator closes the connection
            assert next(lines).startswith("data: ")  # A is running
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", json=b, headers=auth, timeout=httpx.Timeout(60, read=0.2))
            # B's handler polls its client every 0.1 s: B leaves the queue (and the waiting gauge) while A
            # still holds the worker, not when the worker would have reached it.
            def b_gone():
                m = scrape(http)
                return m if sample(m, "vllm:num_requests_waiting") == 0 else None

            now = wait_for(b_gone, what="B to leave the queue")
            assert sample(now, "vllm:num_requests_running") == 1

    def both_aborted():
        now = scrape(http)
        done = sample(now, "vllm:request_success_total", finished_reason="abort") - sample(
            before, "vllm:request_success_total", finished_reason="abort")
        return now if done == 2 and sample(now, "vllm:num_requests_waiting") == 0 else None

    after = wait_for(both_aborted, what="both aborts to be counted")
    # Only A was prefilled: B's prompt never reached the engine.
    assert sample(after, "vllm:prompt_tokens_total") - sample(before, "vllm:prompt_tokens_total") == len("first")


def test_concurrent_requests_are_served_fifo(server, http, client):
    results: dict[int, object] = {}

    def call(i):
        results[i] = client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=20, temperature=0,
                                               extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(r.usage.completion_tokens == 20 for r in results.values())
    now = scrape(http)
    assert sample(now, "vllm:num_requests_waiting") == 0
    assert sample(now, "vllm:num_requests_running") == 0


# -- /metrics ------------------------------------------------------------------------------------


def test_curl_grep_prints_exactly_two_lines(server, client):
    client.completions.create(model=MODEL, prompt=REPETITIVE, max_tokens=8, temperature=0)
    cmd = f'curl -s {server.url}/metrics | grep -E "spec_decode_num_(draft_tokens|accepted_tokens)_total{{"'
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=30)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    assert lines[0].startswith('vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} ')
    assert lines[1].startswith('vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} ')


@pytest.fixture(scope="module")
def local_engine(tiny_dirs):
    """The same target and drafting the server runs, in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.engine.engine import SpeculativeEngine
    from specdec.models.target import Target

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs (see `server`): same kernels, same reduction order
    try:
        yield SpeculativeEngine(Target(model, None, name="tiny"), ngram=3, k=5)
    finally:
        torch.set_num_threads(threads)


def test_metrics_count_exactly_what_the_engine_did(http, client, tokenizer, local_engine):
    from specdec.engine.api import SamplingParams

    prompts = [REPETITIVE, "abc abc abc abc abc abc abc", "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2"]
    before = scrape(http)
    expected = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "prompt": 0, "gen": 0}
    per_pos = [0] * 5
    for p in prompts:
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True})
        ids = tokenizer(p)["input_ids"]
        res = local_engine.generate(ids, SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True))
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == res.new_tokens
        assert r.choices[0].text == tokenizer.decode(res.token_ids, skip_special_tokens=True)
        expected["drafts"] += res.num_drafts
        expected["draft_tokens"] += res.drafted
        expected["accepted"] += res.accepted
        expected["prompt"] += len(ids)
        expected["gen"] += res.new_tokens
        for i, n in enumerate(res.accepted_per_position):
            per_pos[i] += n
    after = scrape(http)

    def d(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert expected["draft_tokens"] > 0 and expected["accepted"] > 0  # n-gram lookup found repeats
    assert d(SPEC["drafts"]) == expected["drafts"]
    assert d(SPEC["draft_tokens"]) == expected["draft_tokens"]
    assert d(SPEC["accepted"]) == expected["accepted"]
    assert [d("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(5)] == per_pos
    assert d("vllm:prompt_tokens_total") == expected["prompt"]
    assert d("vllm:generation_tokens_total") == expected["gen"]
    assert d("vllm:request_success_total", finished_reason="length") == len(prompts)
    assert d("vllm:e2e_request_latency_seconds_count") == len(prompts)
    assert d("vllm:time_to_first_token_seconds_count") == len(prompts)
    assert d("vllm:inter_token_latency_seconds_count") > 0


def test_metrics_text_shape(http):
    text = http.get("/metrics").text
    # prometheus_client >= 0.22 names the family with its _total suffix in # TYPE, older ones without.
    assert re.search(r"^# TYPE vllm:spec_decode_num_drafts(_total)? counter$", text, re.MULTILINE)
    assert 'specdec:build_info{k="5",mode="ngram",version=' in text
    for pos in range(5):  # positions 0..k-1 exist before any draft is accepted there
        assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total'
                f'{{engine="0",model_name="tiny",position="{pos}"}}') in text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:request_success_total"):
        assert name in text


def test_diagnose_reads_the_server(server, http):
    # Traffic of its own, so the test does not depend on what ran before it.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "abcabcabcabc", "max_tokens": 16,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    counters = scrape(http)
    out = subprocess.run(
        ["bash", "-c", f"curl -s {server.url}/metrics | {shlex.quote(sys.executable)} -m specdec diagnose - --json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["num_draft_tokens"] == sample(counters, SPEC["draft_tokens"])
    assert result["acceptance_rate"] == pytest.approx(
        sample(counters, SPEC["accepted"]) / sample(counters, SPEC["draft_tokens"]))
    assert result["k"] == 5
