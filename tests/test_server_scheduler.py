"""The server's scheduler with a scripted engine: FIFO order, cancellation within one engine step,
requests dropped while waiting, and an engine failure that fails one request only."""

import asyncio
import threading

import pytest

from specdec.engine.api import SamplingParams, StepOutput
from specdec.models.tiny import byte_tokenizer
from specdec.server.metrics import ServerMetrics
from specdec.server.scheduler import Scheduler


class ScriptedEngine:
    """Yields one token per step; step `pause_at` of each request waits for `gate`."""

    def __init__(self, tok, pause_at: int | None = None, fail_on: str | None = None):
        self.tok = tok
        self.pause_at = pause_at
        self.fail_on = fail_on
        self.gate = threading.Event()
        self.reached_pause = threading.Event()
        self.calls: list[str] = []
        self.steps_run = 0

    def generate_iter(self, prompt_ids, params: SamplingParams):
        prompt = self.tok.decode(prompt_ids)
        self.calls.append(prompt)
        if prompt == self.fail_on:
            raise RuntimeError("scripted failure")
        letter = self.tok("x", add_special_tokens=False)["input_ids"]
        for i in range(params.max_new_tokens):
            if i == self.pause_at:
                self.reached_pause.set()
                assert self.gate.wait(10)
            self.steps_run += 1
            last = i == params.max_new_tokens - 1
            yield StepOutput(token_ids=list(letter), drafted=2, accepted=1, accepted_positions=[True, False],
                             finished=last, finish_reason="length" if last else None)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def run_async(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def drain(job):
    events = []
    while True:
        ev = await job.events.get()
        events.append(ev)
        if ev.finished:
            return events


def make(tok, engine):
    metrics = ServerMetrics("m", positions=2, mode="scripted", k=2)
    sched = Scheduler(engine, tok, metrics)
    sched.start()
    return sched, metrics


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels}) or 0.0


def test_cancel_takes_effect_within_one_step(tok):
    engine = ScriptedEngine(tok, pause_at=3)
    sched, metrics = make(tok, engine)

    async def main():
        job = sched.submit(tok("a")["input_ids"], SamplingParams(max_new_tokens=50), [])
        await asyncio.get_running_loop().run_in_executor(None, engine.reached_pause.wait, 10)
        job.cancel()  # while step 3 is in flight
        engine.gate.set()
        return await drain(job)

    try:
        events = run_async(main())
    finally:
        sched.stop()
    final = events[-1]
    assert final.finish_reason == "abort"
    assert engine.steps_run == 4  # steps 0..2, then the one in flight when cancelled; no more
    assert final.completion_tokens == 4
    assert value(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(metrics, "vllm:spec_decode_num_drafts_total") == 4
    assert value(metrics, "vllm:spec_decode_num_draft_tokens_total") == 8
    assert value(metrics, "vllm:spec_decode_num_accepted_tokens_total") == 4
    assert value(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 4
    assert value(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 0
    assert value(metrics, "vllm:num_requests_running") == 0


def test_fifo_and_a_request_cancelled_while_waiting_never_runs(tok):
    engine = ScriptedEngine(tok, pause_at=1)
    sched, metrics = make(tok, engine)

    async def main():
        a = sched.submit(tok("A")["input_ids"], SamplingParams(max_new_tokens=3), [])
        b = sched.submit(tok("B")["input_ids"], SamplingParams(max_new_tokens=3), [])
        c = sched.submit(tok("C")["input_ids"], SamplingParams(max_new_tokens=3), [])
        await asyncio.get_running_loop().run_in_executor(None, engine.reached_pause.wait, 10)
        assert value(metrics, "vllm:num_requests_waiting") == 2
        b.cancel()
        engine.gate.set()
        return await drain(a), await drain(b), await drain(c)

    try:
        ea, eb, ec = run_async(main())
    finally:
        sched.stop()
    assert engine.calls == ["A", "C"]  # B was dropped without a prefill
    assert ea[-1].finish_reason == "length" and "".join(e.text for e in ea) == "xxx"
    assert eb[-1].finish_reason == "abort" and eb[-1].completion_tokens == 0
    assert ec[-1].finish_reason == "length"
    assert value(metrics, "vllm:prompt_tokens_total") == 2  # A and C, one byte each
    assert value(metrics, "vllm:num_requests_waiting") == 0


def test_engine_failure_fails_one_request_and_the_worker_goes_on(tok):
    engine = ScriptedEngine(tok, fail_on="boom")
    engine.gate.set()
    sched, metrics = make(tok, engine)

    async def main():
        bad = sched.submit(tok("boom")["input_ids"], SamplingParams(max_new_tokens=3), [])
        good = sched.submit(tok("ok")["input_ids"], SamplingParams(max_new_tokens=3), [])
        return await drain(bad), await drain(good)

    try:
        bad, good = run_async(main())
    finally:
        sched.stop()
    assert bad[-1].error and "scripted failure" in bad[-1].error and bad[-1].status == 500
    assert good[-1].finish_reason == "length" and good[-1].error is None
    # Counted apart from client aborts, as vLLM v1 does (FinishReason.ERROR, vllm/v1/engine/__init__.py:77-78
    # of vllm 0.34.0: "retryable request-level internal error ... always converted to 500").
    assert value(metrics, "vllm:request_success_total", finished_reason="error") == 1
    assert value(metrics, "vllm:request_success_total", finished_reason="abort") == 0


def test_stop_string_ends_generation_after_the_step_that_produced_it(tok):
    engine = ScriptedEngine(tok)
    engine.gate.set()
    sched, _ = make(tok, engine)

    async def main():
        job = sched.submit(tok("a")["input_ids"], SamplingParams(max_new_tokens=40), ["xxxx"])
        return await drain(job)

    try:
        events = run_async(main())
    finally:
        sched.stop()
    assert events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events) == ""  # everything before the stop string ("") and nothing after
    assert engine.steps_run == 4
