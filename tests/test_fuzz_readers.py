"""Property-based fuzzing of what specdec reads from outside: Prometheus text and SGLang's server
info for `diagnose`, and the dataset and JSONL readers. Whatever the input, the answer is a result
or a SpecdecError (one line for the user), never another exception."""

import http.server
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.errors import SpecdecError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

NAMES = ["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
         "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
         "vllm:spec_decode_num_drafts_created", "sglang:spec_accept_length", "sglang:spec_accept_rate",
         "vllm:generation_tokens_total", "specdec:build_info", "junk"]
LABELS = st.dictionaries(st.sampled_from(["model_name", "engine", "position", "mode", "k", "x"]),
                         st.one_of(st.integers(-3, 12).map(str), st.text(max_size=6)), max_size=4)
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers(-10, 10**6).map(str),
                   st.sampled_from(["NaN", "+Inf", "-Inf", "1e400", "x", ""]))


@st.composite
def metric_lines(draw):
    name = draw(st.sampled_from(NAMES))
    labels = draw(LABELS)
    body = ",".join(f'{k}="{v.replace(chr(92), "").replace(chr(34), "")}"' for k, v in labels.items())
    line = f"{name}{{{body}}} {draw(VALUES)}" if labels else f"{name} {draw(VALUES)}"
    return draw(st.sampled_from([line, f"# TYPE {name} counter", f"# HELP {name} x", draw(st.text(max_size=40))]))


@FUZZ
@given(st.lists(metric_lines(), max_size=30))
def test_diagnose_on_any_metrics_text_answers_or_says_why(tmp_path_factory, lines):
    from specdec.diagnose.core import diagnose

    path = tmp_path_factory.mktemp("m") / "metrics.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    try:
        out = diagnose(str(path))
    except SpecdecError as e:
        assert str(e)
    else:
        json.dumps(out)  # what --json prints


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(st.sampled_from(["avg_spec_accept_length",
                                                                             "internal_states", "x"]), inner,
                                                            max_size=3)), max_leaves=12)


@pytest.fixture(scope="module")
def info_server():
    """A real HTTP server on localhost answering /get_server_info with whatever `payload` holds."""
    payload = {"body": b"{}"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload["body"])

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", payload
    srv.shutdown()


@FUZZ
@given(st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=60)))
def test_sglang_server_info_of_any_shape_gives_a_length_or_none(info_server, body):
    from specdec.diagnose.metrics import fetch_server_info_accept_length

    url, payload = info_server
    payload["body"] = body
    got = fetch_server_info_accept_length(url + "/metrics", timeout=5)
    assert got is None or (isinstance(got, float) and got > 0)


@FUZZ
@given(st.binary(max_size=300), st.sampled_from([".jsonl", ".json"]))
def test_dataset_readers_on_any_bytes_answer_or_say_why(tmp_path_factory, data, suffix):
    from specdec.atomic import read_jsonl
    from specdec.data.datasets import load_conversations

    path = tmp_path_factory.mktemp("d") / f"data{suffix}"
    path.write_bytes(data)
    for read in (load_conversations, read_jsonl):
        try:
            read(str(path))
        except SpecdecError as e:
            assert str(e)


@FUZZ
@given(st.lists(JSON, max_size=5))
def test_dataset_reader_on_json_records_of_any_shape(tmp_path_factory, records):
    from specdec.data.datasets import load_conversations

    path = tmp_path_factory.mktemp("d") / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    try:
        convs = load_conversations(str(path))
    except SpecdecError as e:
        assert str(e)
    else:
        assert all(c.messages and all(isinstance(m.get("content"), str) for m in c.messages) for c in convs)
