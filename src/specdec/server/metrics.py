"""The /metrics of `specdec serve`: vLLM's metric names, so `specdec diagnose`, existing Grafana
dashboards and Prometheus queries written for vLLM read this server unchanged.

Counters (the text format appends `_total`; each also has the `_created` timestamp vLLM's scrapes
carry, which `diagnose` uses to notice a restart), labels `model_name` and `engine` ("0"):

    vllm:spec_decode_num_drafts                  steps that proposed at least one draft token
    vllm:spec_decode_num_draft_tokens            draft tokens proposed
    vllm:spec_decode_num_accepted_tokens         draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos (+ label position 0..k-1) steps whose draft
                                                 position i was accepted
    vllm:prompt_tokens, vllm:generation_tokens   tokens prefilled / generated
    vllm:request_success                         (+ label finished_reason: stop, length, abort,
                                                 error: an engine failure, as vLLM v1 counts it)

Histograms: vllm:time_to_first_token_seconds (arrival -> first token, queueing included),
vllm:inter_token_latency_seconds (one observation per engine step, as vLLM v1 does with
speculative decoding), vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds.
Gauges: vllm:num_requests_running, vllm:num_requests_waiting, and `specdec:build_info`, the
marker by which `diagnose` knows it reads specdec.

acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts;
per_pos[i] / drafts = P(at least i+1 drafts accepted).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..engine.api import StepOutput

SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM v1's buckets, so dashboards' quantiles line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """One CollectorRegistry per server (never the process-global one, so tests and embedders can
    build several apps). `positions` = draft positions to pre-create (k, or the tree depth), so a
    fresh scrape already tells `diagnose` the k in use."""

    def __init__(self, model_name: str, *, positions: int = 0, mode: str = "plain", k: int = 0,
                 version: str = ""):
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine": "0"}
        names = list(self.labels)
        r = self.registry

        def counter(name, doc, extra=()):
            return Counter(name, doc, names + list(extra), registry=r)

        self._drafts = counter(SPEC_DRAFTS, "Number of spec decoding drafts.").labels(**self.labels)
        self._draft_tokens = counter(SPEC_DRAFT_TOKENS, "Number of draft tokens.").labels(**self.labels)
        self._accepted = counter(SPEC_ACCEPTED, "Number of accepted tokens.").labels(**self.labels)
        self._per_pos_family = counter(
            SPEC_ACCEPTED_PER_POS, "Accepted tokens per draft position.", ["position"]
        )
        self._per_pos = []
        self._ensure_positions(positions)
        self._prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(**self.labels)
        self._generation = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(**self.labels)
        success = counter("vllm:request_success", "Count of finished requests.", ["finished_reason"])
        self._success = {reason: success.labels(**self.labels, finished_reason=reason) for reason in FINISH_REASONS}

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**self.labels)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between engine steps in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                             E2E_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time spent waiting in the queue.",
                                    E2E_BUCKETS)
        self.running = Gauge("vllm:num_requests_running", "Number of requests being generated.", names,
                             registry=r).labels(**self.labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting in the queue.", names,
                             registry=r).labels(**self.labels)
        info = Gauge("specdec:build_info", "specdec server identity (value 1).",
                     ["version", "mode", "k"], registry=r)
        info.labels(version=version, mode=mode, k=str(k)).set(1)

    def _ensure_positions(self, n: int) -> None:
        while len(self._per_pos) < n:
            self._per_pos.append(self._per_pos_family.labels(**self.labels, position=str(len(self._per_pos))))

    def observe_step(self, step: StepOutput) -> None:
        self._generation.inc(len(step.token_ids))
        if step.drafted > 0:
            self._drafts.inc()
            self._draft_tokens.inc(step.drafted)
            self._accepted.inc(step.accepted)
            self._ensure_positions(len(step.accepted_positions))
            for i, ok in enumerate(step.accepted_positions):
                if ok:
                    self._per_pos[i].inc()

    def observe_prompt(self, n_tokens: int) -> None:
        self._prompt.inc(n_tokens)

    def observe_finish(self, reason: str) -> None:
        self._success[reason if reason in self._success else "abort"].inc()

    def render(self) -> tuple[bytes, str]:
        """(body, content type) in the Prometheus text format 0.0.4."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
