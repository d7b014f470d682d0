"""The request queue and the one engine worker of `specdec serve`.

Scheduling, exactly:
- FIFO. Requests enter one queue in arrival order; one worker thread takes the oldest and runs
  it to completion before looking at the next. One sequence is generated at a time (the engine is
  batch-1 and not thread-safe), so a request's time to first token includes the full generation
  time of every request ahead of it; `vllm:num_requests_waiting` shows the queue.
- Cancellation granularity = one engine step. The HTTP side sets a request's `cancelled` flag
  when its client disconnects; the worker checks it between steps (one target forward pass, which
  commits 1..k+1 tokens), so a cancelled request costs at most one more step. A request cancelled
  while still waiting is dropped without running.
- A stop string found in the decoded text ends the request like a cancellation does (after the
  step that produced it), with finish_reason "stop".
- An engine error fails that request only (its client gets an error) and the worker moves on.

The worker hands events to the request's asyncio.Queue through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine.api import SamplingParams
from .metrics import ServerMetrics
from .text import TextStream

log = logging.getLogger("specdec.server")


@dataclass
class Event:
    """What the worker tells a request: a text delta, and at the end the finish reason + usage."""

    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.perf_counter)
    id: int = 0

    def cancel(self) -> None:
        self.cancelled.set()

    def _emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class Scheduler:
    def __init__(self, engine, tokenizer, metrics: ServerMetrics):
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not re-entrant across threads
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, prompt_ids: list[int], params: SamplingParams, stop: list[str]) -> Job:
        job = Job(prompt_ids, params, stop, asyncio.get_running_loop(), id=next(self._ids))
        self.metrics.waiting.inc()
        self._queue.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.metrics.waiting.dec()
            if job.cancelled.is_set():
                self.metrics.observe_finish("abort")
                job._emit(Event(finished=True, finish_reason="abort", prompt_tokens=len(job.prompt_ids)))
                continue
            self.metrics.running.inc()
            try:
                final = self._generate(job)
            finally:
                self.metrics.running.dec()  # before the client hears it finished
            job._emit(final)

    def _generate(self, job: Job) -> Event:
        """Run one request, streaming its deltas; returns its final event."""
        m = self.metrics
        start = time.perf_counter()
        m.queue_time.observe(start - job.arrival)
        m.observe_prompt(len(job.prompt_ids))
        text = TextStream(self.tokenizer, job.stop, lock=self.tokenizer_lock)
        produced = 0
        reason = "abort"
        delta = ""
        last = None
        steps = self.engine.generate_iter(job.prompt_ids, job.params)
        try:
            for step in steps:
                now = time.perf_counter()
                if last is None:
                    m.ttft.observe(now - job.arrival)
                else:
                    m.itl.observe(now - last)
                last = now
                m.observe_step(step)
                produced += len(step.token_ids)
                delta = text.push(step.token_ids)
                if step.finished:
                    reason = "stop" if text.stopped else (step.finish_reason or "length")
                    break
                if text.stopped:
                    reason = "stop"
                    break
                if delta:
                    job._emit(Event(text=delta))
                    delta = ""
                if job.cancelled.is_set():
                    break
            else:
                reason = "length"
        except Exception as e:  # an engine bug must fail one request, not the server
            log.exception("request %d failed", job.id)
            m.observe_finish("abort")
            return Event(finished=True, finish_reason="abort", error=f"{type(e).__name__}: {e}",
                         prompt_tokens=len(job.prompt_ids), completion_tokens=produced)
        finally:
            steps.close()
        if reason != "abort":
            delta += text.finish()
        m.e2e.observe(time.perf_counter() - job.arrival)
        m.observe_finish(reason)
        return Event(text=delta if reason != "abort" else "", finished=True, finish_reason=reason,
                     prompt_tokens=len(job.prompt_ids), completion_tokens=produced)
