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
- An engine error fails that request only (its client gets an error, /metrics counts it as
  finished_reason "error") and the worker moves on.
- Bounded: at most `max_waiting` requests wait; one more is refused at once (`QueueFull`, a 429
  with Retry-After). A request still waiting after `queue_timeout` seconds, or whose client went
  away, is dropped without running, and leaves `vllm:num_requests_waiting` at once.
- Drain (SIGTERM): nothing new is accepted, waiting requests end with "shutting down" (503), the
  running one may finish within the drain timeout, else it is ended cleanly like a cancellation.

Continuous batching (several sequences per target pass) would need a batched engine: per-sequence
KV caches of different lengths, verification of several drafts in one pass, and a step loop that
admits and retires sequences between steps; the engine is batch-1, so the queue stays FIFO.

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
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    status: int = 500  # the HTTP status of `error`: 500 an engine failure, 503 shutdown or queue timeout
    code: str | None = None  # and its OpenAI error code


class QueueFull(Exception):
    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"{waiting} requests are waiting, the most this server queues")
        self.waiting, self.retry_after = waiting, retry_after


class ShuttingDown(Exception):
    pass


WAITING, RUNNING, DONE = "waiting", "running", "done"


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
    started: threading.Event = field(default_factory=threading.Event)  # the worker took it (or it ended)
    woken: asyncio.Event = field(default_factory=asyncio.Event)  # `started`, seen from the event loop
    state: str = WAITING
    scheduler: "Scheduler | None" = None
    dropped: Event | None = None  # how it ended if it never ran

    def cancel(self, reason: str | None = None, code: str | None = None) -> None:
        """Stop this request: one still waiting leaves the queue now (ending with `reason` as its
        error, a 503 with `code`, when given); one running stops after the current engine step."""
        self.cancelled.set()
        if self.scheduler is not None:
            self.scheduler._drop_waiting(self, reason, code)

    def _mark_started(self) -> None:
        self.started.set()
        try:  # wake the request waiting on the event loop now rather than at its next poll
            self.loop.call_soon_threadsafe(self.woken.set)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class Scheduler:
    def __init__(self, engine, tokenizer, metrics: ServerMetrics, *, max_waiting: int = 64,
                 queue_timeout: float = 600.0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_waiting, self.queue_timeout = max_waiting, queue_timeout
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers are not re-entrant across threads
        self._lock = threading.Lock()  # job states, the waiting count and the gauge move together
        self._waiting = 0
        self._running: Job | None = None
        self._draining = False
        self._service = 1.0  # seconds a request takes, a moving average (for Retry-After)
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
        job = Job(prompt_ids, params, stop, asyncio.get_running_loop(), id=next(self._ids), scheduler=self)
        with self._lock:
            if self._draining:
                raise ShuttingDown("the server is shutting down")
            if self._waiting >= self.max_waiting:
                raise QueueFull(self._waiting, max(1, round(self._service * (self._waiting + 1))))
            self._waiting += 1
            self.metrics.waiting.inc()
        self._queue.put(job)
        return job

    def expired(self, job: Job) -> bool:
        """Waited longer than the queue timeout without being started."""
        return job.state == WAITING and time.perf_counter() - job.arrival > self.queue_timeout

    def _drop_waiting(self, job: Job, reason: str | None, code: str | None) -> None:
        with self._lock:
            if job.state != WAITING:
                return
            job.state = DONE
            self._waiting -= 1
            self.metrics.waiting.dec()
        self.metrics.observe_finish("abort")
        job.dropped = Event(finished=True, finish_reason="abort", prompt_tokens=len(job.prompt_ids), error=reason,
                            status=503, code=code)
        job._mark_started()
        job._emit(job.dropped)

    def drain(self, timeout: float) -> None:
        """Refuse new requests, end the waiting ones, and end the running one cleanly if it has not
        finished within `timeout` seconds (called on SIGTERM, from the event loop)."""
        with self._lock:
            self._draining = True
            running = self._running
        with self._queue.mutex:
            waiting = [j for j in self._queue.queue if j is not None]
        for job in waiting:  # they stay queued; the worker skips what is no longer waiting
            job.cancel("the server is shutting down; retry on another replica or after the restart",
                       "shutting_down")
        if running is not None:
            timer = threading.Timer(max(0.0, timeout), lambda: running.cancel())
            timer.daemon = True
            timer.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                if job.state != WAITING:  # cancelled while waiting: already ended and uncounted
                    continue
                job.state = RUNNING
                self._waiting -= 1
                self.metrics.waiting.dec()
                self._running = job
            job._mark_started()
            self.metrics.running.inc()
            t0 = time.perf_counter()
            try:
                final = self._generate(job)
            finally:
                self.metrics.running.dec()  # before the client hears it finished
                with self._lock:
                    job.state, self._running = DONE, None
                    self._service = 0.8 * self._service + 0.2 * (time.perf_counter() - t0)
            if final.finish_reason == "abort" and self._draining and final.error is None:
                final.error, final.status = "the server is shutting down; the request was cut short", 503
                final.code = "shutting_down"
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
            m.observe_finish("error")
            return Event(finished=True, finish_reason="error", error=f"{type(e).__name__}: {e}",
                         prompt_tokens=len(job.prompt_ids), completion_tokens=produced)
        finally:
            steps.close()
        if reason != "abort":
            delta += text.finish()
        m.e2e.observe(time.perf_counter() - job.arrival)
        m.observe_finish(reason)
        return Event(text=delta if reason != "abort" else "", finished=True, finish_reason=reason,
                     prompt_tokens=len(job.prompt_ids), completion_tokens=produced)
