"""Reading speculative-decoding metrics from a live server's /metrics text.

The one place that decides which metric names mean what. vLLM (v1) and specdec's own server expose
counters (`vllm:spec_decode_*`, text adds `_total`, plus `_created` gauges) with labels
`model_name` and `engine`; SGLang exposes gauges (`sglang:spec_accept_*`) snapshotted per log
interval, and a cumulative `avg_spec_accept_length` in `GET /get_server_info`.

Samples are matched by their exact name, never by substring: `..._accepted_tokens_per_pos_total`
contains `accepted_tokens`, and every counter has a `_created` twin that is a timestamp.
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpecdecError

VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
VLLM_EMITTED = "vllm:spec_decode_num_emitted_tokens"  # vLLM v0 only
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"
SGLANG_NUM_DRAFT_TOKENS = "sglang:spec_num_draft_tokens"  # newer SGLang: tree size incl. root
SGLANG_GENERATION_TOKENS = "sglang:generation_tokens"
SGLANG_GEN_THROUGHPUT = "sglang:gen_throughput"
# specdec's server exposes the vLLM names (so existing dashboards work) plus one gauge that
# says who it is, e.g. `specdec:build_info{version="0.1.0"} 1`.
SPECDEC_MARKER_PREFIXES = ("specdec:", "specdec_")
SPECDEC_BUILD_INFO = "specdec:build_info"  # labels version, mode, k: the served k, when speculating

_COUNTERS = {
    VLLM_DRAFTS: "num_drafts",
    VLLM_DRAFT_TOKENS: "num_draft_tokens",
    VLLM_ACCEPTED: "num_accepted_tokens",
    VLLM_EMITTED: "num_emitted_tokens",
}

LabelSet = tuple[tuple[str, str], ...]


def label_set(labels: dict[str, str], *, drop: tuple[str, ...] = ("position",)) -> LabelSet:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in drop))


def format_labels(labels: LabelSet | dict) -> str:
    items = labels.items() if isinstance(labels, dict) else labels
    return ", ".join(f"{k}={v}" for k, v in items) or "(no labels)"


@dataclass(kw_only=True)
class SpecSeries:
    """One label set's vLLM-style counters (cumulative values, or deltas after `delta`)."""

    labels: LabelSet = ()
    num_drafts: float | None = None
    num_draft_tokens: float | None = None
    num_accepted_tokens: float | None = None
    num_emitted_tokens: float | None = None
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    created: float | None = None  # earliest `_created` of the set: changes when the server restarts
    reset: bool = False  # set by `delta` when a counter went backwards or was re-created


@dataclass(kw_only=True)
class SGLangSeries:
    labels: LabelSet = ()
    accept_length: float | None = None  # tokens per verify pass, bonus included
    accept_rate: float | None = None  # (accepted + bonus) / tree size, as SGLang reports it
    num_draft_tokens: float | None = None  # tree size incl. the root, when exposed


@dataclass(kw_only=True)
class Scrape:
    source: str
    engine: str = "unknown"  # vllm | specdec | sglang | unknown
    spec: dict[LabelSet, SpecSeries] = field(default_factory=dict)
    sglang: dict[LabelSet, SGLangSeries] = field(default_factory=dict)
    generation_tokens: dict[LabelSet, float] = field(default_factory=dict)
    gen_throughput_gauge: float | None = None  # SGLang's own windowed tok/s
    server_info_accept_length: float | None = None  # SGLang, cumulative since start
    k_hint: int | None = None  # the served k, when the server states it (specdec:build_info)
    mode_hint: str | None = None  # the drafting mode, when the server states it (specdec:build_info)
    taken_at: float = field(default_factory=time.monotonic)

    @property
    def has_spec(self) -> bool:
        return bool(self.spec) or any(s.accept_length for s in self.sglang.values())

    @property
    def total_generation_tokens(self) -> float | None:
        return sum(self.generation_tokens.values()) if self.generation_tokens else None


# ---------------------------------------------------------------------------------------------
# Getting the text


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def metrics_url(url: str) -> str:
    """A server's base URL gets `/metrics` appended; anything with a path is used as given."""
    parts = urllib.parse.urlsplit(url)
    if parts.path in ("", "/"):
        return urllib.parse.urlunsplit(parts._replace(path="/metrics"))
    return url


def base_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    path = parts.path
    for suffix in ("/metrics", "/metrics/"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return urllib.parse.urlunsplit(parts._replace(path=path.rstrip("/"), query="", fragment=""))


def _http_get(url: str, timeout: float, accept: str) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "specdec-diagnose"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (user-given URL)
        return resp.read()


def fetch_text(url: str, *, timeout: float = 10.0) -> str:
    """GET a /metrics page; unreachable servers and HTTP errors become one-line SpecdecErrors."""
    try:
        return _http_get(url, timeout, "text/plain;version=0.0.4").decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        hint = (
            "SGLang serves /metrics only with --enable-metrics"
            if e.code == 404
            else "check the URL and that the server is healthy"
        )
        raise SpecdecError(
            f"{url} answered HTTP {e.code} {e.reason}: expected a Prometheus /metrics page; {hint}"
        ) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise SpecdecError(
            f"could not reach {url} ({reason}): expected a running vLLM/SGLang/specdec server; "
            "check the host and port (vLLM serves /metrics on its API port)"
        ) from None


def fetch_server_info_accept_length(url: str, *, timeout: float = 5.0) -> float | None:
    """SGLang's cumulative mean acceptance length from /get_server_info, or None if unavailable."""
    base = base_url(url)
    for path in ("/get_server_info", "/server_info"):
        try:
            info = json.loads(_http_get(base + path, timeout, "application/json"))
        except (urllib.error.URLError, OSError, ValueError):
            continue
        values = [v for v in _find_key(info, "avg_spec_accept_length") if _finite(v)]
        if values:
            return sum(values) / len(values)
    return None


def _find_key(obj, key: str, depth: int = 0) -> list:
    """Every value of `key` in nested dicts/lists (top level, or under internal_states[...])."""
    if depth > 4:
        return []
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                found.append(v)
            elif isinstance(v, (dict, list)):
                found.extend(_find_key(v, key, depth + 1))
    elif isinstance(obj, list):
        for v in obj:
            found.extend(_find_key(v, key, depth + 1))
    return found


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def read_text(source: str) -> str:
    """The text of a saved metrics file, or of stdin for `-`."""
    if source == "-":
        return sys.stdin.read()
    path = Path(source)
    if not path.exists():
        raise SpecdecError(
            f"{source} does not exist: expected a /metrics URL (http://host:port/metrics), "
            "a saved metrics text file, or - for stdin"
        )
    if path.is_dir():
        raise SpecdecError(f"{source} is a directory: expected a saved metrics text file")
    return path.read_text(encoding="utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Parsing


def _counter_name(sample_name: str) -> str | None:
    """The base counter name of a `_total` sample (or of an untyped bare one); None for `_created`."""
    if sample_name.endswith("_created"):
        return None
    if sample_name.endswith("_total"):
        return sample_name[: -len("_total")]
    return sample_name


def parse_metrics(text: str, *, source: str = "<text>") -> Scrape:
    """Parse Prometheus text exposition into the spec-decode series it holds (maybe none)."""
    from prometheus_client.parser import text_string_to_metric_families

    scrape = Scrape(source=source)
    stripped = text.lstrip()
    if stripped.startswith(("<", "{", "[")):
        kind = "HTML" if stripped.startswith("<") else "JSON"
        raise SpecdecError(
            f"{source} holds {kind}, not Prometheus text: expected the body of a /metrics endpoint "
            "(lines like `vllm:spec_decode_num_drafts_total{...} 123`)"
        )
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, IndexError, KeyError) as e:
        raise SpecdecError(
            f"could not parse {source} as Prometheus text ({e}): expected the body of a /metrics "
            "endpoint, e.g. saved with `curl -s http://host:port/metrics > metrics.txt`"
        ) from None

    marker = False
    gen_total = {}
    for family in families:
        if family.name.startswith(SPECDEC_MARKER_PREFIXES):
            marker = True
            if family.name == SPECDEC_BUILD_INFO:
                for sample in family.samples:
                    k = sample.labels.get("k", "")
                    if k.isdigit() and int(k) > 0:
                        scrape.k_hint = int(k)
                    scrape.mode_hint = sample.labels.get("mode") or scrape.mode_hint
        for sample in family.samples:
            name = sample.name
            if name.endswith("_created"):
                base = name[: -len("_created")]
                if base in _COUNTERS or base == VLLM_ACCEPTED_PER_POS:
                    series = _spec(scrape, sample.labels)
                    if series.created is None or sample.value < series.created:
                        series.created = sample.value
                continue
            if not _finite_or_zero(sample.value):
                continue
            base = _counter_name(name)
            if base in _COUNTERS:
                series = _spec(scrape, sample.labels)
                attr = _COUNTERS[base]
                setattr(series, attr, (getattr(series, attr) or 0.0) + sample.value)
            elif base == VLLM_ACCEPTED_PER_POS:
                pos = sample.labels.get("position")
                if pos is None or not pos.isdigit():
                    continue
                series = _spec(scrape, sample.labels)
                series.accepted_per_pos[int(pos)] = series.accepted_per_pos.get(int(pos), 0.0) + sample.value
            elif base in (VLLM_GENERATION_TOKENS, SGLANG_GENERATION_TOKENS) and name.endswith("_total"):
                key = label_set(sample.labels)
                gen_total[key] = gen_total.get(key, 0.0) + sample.value
            elif name == SGLANG_ACCEPT_LENGTH:
                _sgl(scrape, sample.labels).accept_length = sample.value
            elif name == SGLANG_ACCEPT_RATE:
                _sgl(scrape, sample.labels).accept_rate = sample.value
            elif name == SGLANG_NUM_DRAFT_TOKENS:
                _sgl(scrape, sample.labels).num_draft_tokens = sample.value
            elif name == SGLANG_GEN_THROUGHPUT:
                scrape.gen_throughput_gauge = (scrape.gen_throughput_gauge or 0.0) + sample.value
    scrape.generation_tokens = gen_total
    # A label set that only carried `_created` timestamps has no counts: drop it.
    scrape.spec = {
        k: s
        for k, s in scrape.spec.items()
        if s.num_drafts is not None or s.num_draft_tokens is not None or s.accepted_per_pos
    }
    if scrape.spec:
        scrape.engine = "specdec" if marker else "vllm"
    elif scrape.sglang:
        scrape.engine = "sglang"
    return scrape


def _finite_or_zero(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _spec(scrape: Scrape, labels: dict[str, str]) -> SpecSeries:
    key = label_set(labels)
    if key not in scrape.spec:
        scrape.spec[key] = SpecSeries(labels=key)
    return scrape.spec[key]


def _sgl(scrape: Scrape, labels: dict[str, str]) -> SGLangSeries:
    key = label_set(labels)
    if key not in scrape.sglang:
        scrape.sglang[key] = SGLangSeries(labels=key)
    return scrape.sglang[key]


def require_spec(scrape: Scrape) -> Scrape:
    if not scrape.has_spec:
        raise SpecdecError(
            f"no speculative-decoding metrics found in {scrape.source}: expected "
            "vllm:spec_decode_* counters or sglang:spec_accept_* gauges; is speculative decoding "
            "enabled on that server (vLLM --speculative-config, SGLang --speculative-algorithm "
            "with --enable-metrics)?"
        )
    return scrape


def scrape_url(url: str, *, timeout: float = 10.0, server_info: bool = True) -> Scrape:
    """One scrape of a live server (plus SGLang's cumulative server info when relevant)."""
    url = metrics_url(url)
    taken_at = time.monotonic()
    scrape = parse_metrics(fetch_text(url, timeout=timeout), source=url)
    scrape.taken_at = taken_at
    if server_info and scrape.engine == "sglang":
        scrape.server_info_accept_length = fetch_server_info_accept_length(url)
    return scrape


def load_source(source: str) -> Scrape:
    """A saved metrics file or stdin, parsed (no deltas: values are totals since server start)."""
    label = "stdin" if source == "-" else source
    return parse_metrics(read_text(source), source=label)


# ---------------------------------------------------------------------------------------------
# Deltas


def _counter_delta(before: float | None, after: float | None, reset: bool) -> float | None:
    """after - before; a counter that went backwards (or was re-created) restarted from zero."""
    if after is None:
        return None
    if before is None or reset:
        return after
    d = after - before
    return after if d < 0 else d


def delta(before: Scrape, after: Scrape) -> Scrape:
    """What happened between two scrapes: counter deltas per label set, SGLang's latest gauges.

    A label set whose counters went backwards, or whose `_created` changed, belongs to a
    restarted server; its delta is its new value (everything counted since the restart).
    """
    out = Scrape(
        source=after.source,
        engine=after.engine,
        sglang=after.sglang,  # gauges: the latest snapshot is the window's value
        gen_throughput_gauge=after.gen_throughput_gauge,
        server_info_accept_length=after.server_info_accept_length,
        k_hint=after.k_hint,
        mode_hint=after.mode_hint,
        taken_at=after.taken_at,
    )
    for key, a in after.spec.items():
        b = before.spec.get(key)
        if b is None:
            out.spec[key] = SpecSeries(**{**a.__dict__, "accepted_per_pos": dict(a.accepted_per_pos)})
            continue
        reset = a.created is not None and b.created is not None and abs(a.created - b.created) > 1e-6
        values = [
            (a.num_drafts, b.num_drafts),
            (a.num_draft_tokens, b.num_draft_tokens),
            (a.num_accepted_tokens, b.num_accepted_tokens),
            (a.num_emitted_tokens, b.num_emitted_tokens),
        ] + [(a.accepted_per_pos[p], b.accepted_per_pos.get(p)) for p in a.accepted_per_pos]
        reset = reset or any(av is not None and bv is not None and av < bv for av, bv in values)
        out.spec[key] = SpecSeries(
            labels=key,
            num_drafts=_counter_delta(b.num_drafts, a.num_drafts, reset),
            num_draft_tokens=_counter_delta(b.num_draft_tokens, a.num_draft_tokens, reset),
            num_accepted_tokens=_counter_delta(b.num_accepted_tokens, a.num_accepted_tokens, reset),
            num_emitted_tokens=_counter_delta(b.num_emitted_tokens, a.num_emitted_tokens, reset),
            accepted_per_pos={
                p: _counter_delta(b.accepted_per_pos.get(p), v, reset)
                for p, v in a.accepted_per_pos.items()
            },
            created=a.created,
            reset=reset,
        )
    for key, v in after.generation_tokens.items():
        out.generation_tokens[key] = _counter_delta(before.generation_tokens.get(key), v, False)
    return out
