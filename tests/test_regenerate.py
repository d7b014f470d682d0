"""`specdec regenerate`: in-process batched generation, resume after a torn line or kill -9, and
OpenAI-compatible endpoints (a real `specdec serve` process; a stub only for the retry path)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from specdec.atomic import read_jsonl
from specdec.data.datasets import Conversation
from specdec.data.regenerate import RegenConfig, generate_batch, regenerate_endpoint, regenerate_local, split_turns


def convs(n=3):
    out = [
        Conversation(id="multi", messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": "Blue (an old answer to be replaced)."},
            {"role": "user", "content": "Another one?"},
        ]),
        Conversation(id="mt", messages=[{"role": "user", "content": "Write a haiku."}], followups=["Now shorter."]),
        Conversation(id="one", messages=[{"role": "user", "content": "hi"}]),
    ]  # fmt: skip
    out += [Conversation(id=f"p{i}", messages=[{"role": "user", "content": "tell me " * (i + 1)}])
            for i in range(n - 3)]
    return out[:n]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_targets):
    return tiny_targets["llama"]


def test_split_turns_keeps_user_turns_and_system():
    c = split_turns(convs()[0])
    assert c.messages == [{"role": "system", "content": "Be brief."}]
    assert c.turns == ["Name a color.", "Another one?"]
    assert split_turns(convs()[1]).turns == ["Write a haiku.", "Now shorter."]
    assert split_turns(convs()[0], single_turn=True).turns == ["Name a color."]


def test_in_process_replaces_every_assistant_turn(target, tmp_path):
    out = tmp_path / "regen.jsonl"
    s = regenerate_local(target, convs(), out, RegenConfig(max_new_tokens=5), batch_size=2, progress=False)
    recs = {r["id"]: r for r in read_jsonl(out)}
    assert set(recs) == {"multi", "mt", "one"} and s.conversations == 3
    multi = recs["multi"]
    assert [m["role"] for m in multi["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert multi["messages"][1]["content"] == "Name a color."
    assert "old answer" not in json.dumps(multi)
    assert [m["role"] for m in recs["mt"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert recs["mt"]["messages"][2]["content"] == "Now shorter."
    for r in recs.values():
        assert r["target"] == target.name
        assert r["finish_reason"] in ("stop", "length")
        assert len(r["finish_reasons"]) == sum(m["role"] == "assistant" for m in r["messages"])
        assert 1 <= r["new_tokens"] <= 5 * len(r["finish_reasons"])
    assert s.new_tokens == sum(r["new_tokens"] for r in recs.values())


def test_batched_left_padded_generation_equals_plain_engine(target):
    """Parity: HF generate on a left-padded batch == specdec's own plain greedy decoding."""
    from specdec.data.chat import prompt_ids
    from specdec.engine.api import SamplingParams
    from specdec.engine.engine import SpeculativeEngine

    prompts = [prompt_ids(target.tokenizer, [{"role": "user", "content": t}])
               for t in ("hi", "a much longer prompt here")]
    batched = generate_batch(target, prompts, RegenConfig(max_new_tokens=6))
    engine = SpeculativeEngine(target)
    for p, (ids, reason) in zip(prompts, batched):
        ref = engine.generate(p, SamplingParams(max_new_tokens=6))
        assert ids == ref.token_ids and reason == ref.finish_reason


def test_resume_repairs_torn_line_without_duplicates(target, tmp_path):
    out = tmp_path / "regen.jsonl"
    cfg = RegenConfig(max_new_tokens=4, single_turn=True)
    regenerate_local(target, convs(4), out, cfg, batch_size=4, progress=False)
    first = read_jsonl(out)
    text = out.read_text()
    out.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])  # kill mid-line
    assert len(read_jsonl(out)) == 3
    s = regenerate_local(target, convs(4), out, cfg, batch_size=4, progress=False)
    again = read_jsonl(out)
    assert s.skipped_done == 3 and s.conversations == 1
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in first)
    assert again[:3] == first[:3]  # finished records untouched
    assert out.read_text().endswith("\n") and len(out.read_text().splitlines()) == 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill9_subprocess_then_resume(tiny_dirs, tmp_path, seed):
    """Killed after a random number of records (one seed each), the rerun finishes the rest."""
    import random

    want = random.Random(seed).randint(1, 6)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i} " * 3}) + "\n" for i in range(8)))
    out = tmp_path / "regen.jsonl"
    cmd = [sys.executable, "-m", "specdec", "regenerate", "--target", str(tiny_dirs["llama"]), "--prompts",
           str(prompts), "--max-new-tokens", "24", "--batch-size", "1", "--no-progress", "-o", str(out)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 90
    while len(read_jsonl(out)) < want:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    killed_with = len(read_jsonl(out))
    assert proc.returncode == -signal.SIGKILL and 1 <= killed_with < 8

    from specdec.cli import main

    assert main(cmd[3:]) == 0  # the same command
    recs = read_jsonl(out)
    ids = [r["id"] for r in recs]
    assert sorted(ids) == sorted(f"q{i}" for i in range(8)) and len(set(ids)) == 8
    assert len(out.read_text().splitlines()) == 8
    # What an uninterrupted run writes, record for record (greedy).
    straight = tmp_path / "straight.jsonl"
    assert main(cmd[3:-1] + [str(straight)]) == 0
    assert sorted(recs, key=lambda r: r["id"]) == sorted(read_jsonl(straight), key=lambda r: r["id"])


# -- endpoints -----------------------------------------------------------------------------


def test_endpoint_against_specdec_serve(tiny_dirs, target, tmp_path):
    """A real OpenAI-compatible server: greedy answers equal in-process greedy ones."""
    from specdec.server.launch import ServerProcess

    out, local = tmp_path / "served.jsonl", tmp_path / "local.jsonl"
    cfg = RegenConfig(max_new_tokens=6)
    args = ["--target", str(tiny_dirs["llama"]), "--served-model-name", "tiny", "--dtype", "fp32"]
    with ServerProcess(args, env={"OMP_NUM_THREADS": "1"}) as srv:
        s = regenerate_endpoint(srv.url, convs(), out, cfg, concurrency=2, progress=False)
    assert s.conversations == 3
    regenerate_local(target, convs(), local, cfg, batch_size=1, progress=False)
    served = {r["id"]: r for r in read_jsonl(out)}
    mine = {r["id"]: r for r in read_jsonl(local)}
    assert set(served) == set(mine)
    for k, r in served.items():
        assert r["target"] == "tiny"
        assert [m["role"] for m in r["messages"]] == [m["role"] for m in mine[k]["messages"]]
        assert r["new_tokens"] == mine[k]["new_tokens"]
        assert r["finish_reasons"] == mine[k]["finish_reasons"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def flaky_server():
    """An OpenAI-compatible stub that fails its first call with 500 (retry path only)."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()
    state = {"calls": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        state["calls"] += 1
        body = await request.json()
        if state["calls"] == 1:
            return JSONResponse({"error": "warming up"}, status_code=500)
        last = body["messages"][-1]["content"]
        if "REJECT" in last:
            return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"echo {last}"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(10)


def test_endpoint_retries_5xx_and_records_rejections(flaky_server, tmp_path):
    url, state = flaky_server
    out = tmp_path / "regen.jsonl"
    items = convs() + [Conversation(id="bad", messages=[{"role": "user", "content": "REJECT me"}])]
    s = regenerate_endpoint(url + "/v1", items, out, RegenConfig(max_new_tokens=8), concurrency=1,
                            retry_base_s=0.01, progress=False)
    recs = {r["id"]: r for r in read_jsonl(out)}
    assert set(recs) == {"multi", "mt", "one", "bad"} and s.conversations == 4
    assert recs["multi"]["target"] == "stub-model"  # from GET /v1/models
    assert recs["multi"]["messages"][-1] == {"role": "assistant", "content": "echo Another one?"}
    assert recs["mt"]["new_tokens"] == 6 and recs["mt"]["finish_reasons"] == ["stop", "stop"]
    assert recs["bad"]["finish_reason"] == "rejected" and "400" in recs["bad"]["error"]
    assert state["calls"] == 1 + 2 + 2 + 1 + 1  # the 500, then every turn once
    # Rerun: everything is finished, nothing is asked again.
    s2 = regenerate_endpoint(url, items, out, RegenConfig(max_new_tokens=8), progress=False)
    assert s2.conversations == 0 and s2.skipped_done == 4 and state["calls"] == 7


def test_endpoint_down_fails_with_one_clear_line(tmp_path):
    from specdec.errors import SpecdecError

    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(SpecdecError, match="failed 2 times.*rerun"):
        regenerate_endpoint(url, convs(1), tmp_path / "r.jsonl", model="m", max_retries=1, retry_base_s=0.01,
                            progress=False)
    assert read_jsonl(tmp_path / "r.jsonl") == []


def test_batch_decoder_where_it_applies_and_hf_generate_elsewhere(tiny_targets, tmp_path, capsys):
    from specdec.data.regenerate import batch_decoder, batch_decoder_blocker
    from specdec.errors import SpecdecError

    assert batch_decoder(tiny_targets["llama"]) is not None
    mla = tiny_targets["deepseek_v3"]
    assert batch_decoder(mla) is None and "deepseek_v3" in batch_decoder_blocker(mla)
    # An MLA target still regenerates (HF generate) and says so; forcing the batch decoder on it fails.
    s = regenerate_local(mla, convs(2), tmp_path / "r.jsonl", RegenConfig(max_new_tokens=3), batch_size=2)
    assert s.conversations == 2 and "decoding with HF generate (the fast path supports" in capsys.readouterr().err
    with pytest.raises(SpecdecError, match="batch decoder does not apply"):
        regenerate_local(mla, convs(3), tmp_path / "r.jsonl", RegenConfig(max_new_tokens=3), fast=True)


def test_batch_decoder_writes_what_hf_generate_writes(target, tmp_path):
    """fp32, multi-turn conversations in one batch: the same records either way."""
    cfg = RegenConfig(max_new_tokens=6)
    regenerate_local(target, convs(5), tmp_path / "hf.jsonl", cfg, batch_size=5, progress=False, fast=False)
    regenerate_local(target, convs(5), tmp_path / "batch.jsonl", cfg, batch_size=5, progress=False, fast=True)
    hf, batch = read_jsonl(tmp_path / "hf.jsonl"), read_jsonl(tmp_path / "batch.jsonl")
    assert len(hf) == 5 and hf == batch


def test_out_of_memory_says_what_to_do_and_keeps_what_finished(target, tmp_path, monkeypatch):
    import torch

    import specdec.data.regenerate as regen
    from specdec.errors import SpecdecError

    out = tmp_path / "r.jsonl"
    real = regen.generate_batch
    calls = []

    def second_batch_runs_out(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return real(*a, **k)

    monkeypatch.setattr(regen, "generate_batch", second_batch_runs_out)
    cfg = RegenConfig(max_new_tokens=3, single_turn=True)
    with pytest.raises(SpecdecError, match=r"out of memory decoding 2 conversations .* smaller --batch-size \(now 2\)"):
        regenerate_local(target, convs(4), out, cfg, batch_size=2, progress=False)
    kept = read_jsonl(out)
    assert len(kept) == 2  # the first batch, intact
    monkeypatch.setattr(regen, "generate_batch", real)
    s = regenerate_local(target, convs(4), out, cfg, batch_size=1, progress=False)
    assert s.skipped_done == 2 and len(read_jsonl(out)) == 4
