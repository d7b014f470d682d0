"""Self-distillation data: the target answers its own prompts.

For each conversation the user turns are kept and every assistant turn is replaced by the
target's answer, turn by turn (turn 2 is asked after the target's own turn-1 answer); with
`single_turn` only the first user turn is asked. MT-Bench style follow-ups
(`Conversation.followups`) count as later user turns.

Two back ends, one output format:
  * in process: left-padded batches, decoded greedily by engine/batch.py's BatchDecoder (a static
    cache, each decode step one CUDA graph on CUDA) where the target is a Llama-family model, else
    (sampling, other architectures) by HF `model.generate`. Conversations are sorted
    longest first (padding stays small within a batch, and an out-of-memory shows in the first
    batch, not after hours) and answered `batch_size` conversations at a time, all their turns.
  * `--endpoint`: any OpenAI-compatible server (vLLM, SGLang, `specdec serve`) over httpx with
    bounded concurrency and retries with exponential backoff on connection errors, 429 and 5xx.

Output: JSONL, one line per finished conversation, appended with fsync:
    {"id", "messages": [...], "target", "finish_reason", "new_tokens", "finish_reasons"}
`finish_reason` is the last turn's ("stop", "length", "prompt_too_long" or "rejected");
`finish_reasons` has one per answered turn. A rerun repairs a torn last line and skips finished
ids, so a kill loses at most the conversations in flight and never corrupts the file.

Examples:
    specdec regenerate --target tiny-llama --prompts mt-bench --limit 4 --max-new-tokens 16 -o /tmp/r.jsonl
    specdec regenerate --target smollm2-135m-instruct --prompts sharegpt --limit 1000 -o regen.jsonl
    specdec regenerate --endpoint http://localhost:8000 --prompts sharegpt --concurrency 64 -o regen.jsonl
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..atomic import append_jsonl, repair_jsonl
from ..errors import SpecdecError


@dataclass(kw_only=True)
class RegenConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    single_turn: bool = False


@dataclass
class RegenSummary:
    conversations: int = 0  # finished in this run
    new_tokens: int = 0
    seconds: float = 0.0
    skipped_done: int = 0
    total: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def conversations_per_s(self) -> float:
        return self.conversations / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.finish_reasons.items()))
        return (f"regenerated {self.conversations:,} conversations ({self.skipped_done:,} already done, "
                f"{self.total:,} in all), {self.new_tokens:,} new tokens in {self.seconds:.1f} s: "
                f"{self.tokens_per_s:,.1f} tok/s, {self.conversations_per_s:.2f} conversations/s"
                + (f"; finish: {reasons}" if reasons else ""))


# -- conversation plumbing -----------------------------------------------------------------


@dataclass
class _Convo:
    """A conversation being answered: the messages so far and the user turns still to ask."""

    id: str
    messages: list[dict]
    turns: list[str]
    finish_reasons: list[str] = field(default_factory=list)
    new_tokens: int = 0
    error: str | None = None

    @property
    def done(self) -> bool:
        return not self.turns

    def ask(self) -> list[dict]:
        """Messages to send for the next turn (the next user turn appended)."""
        return self.messages + [{"role": "user", "content": self.turns[0]}]

    def answer(self, text: str, finish_reason: str, new_tokens: int) -> None:
        self.messages = self.ask() + [{"role": "assistant", "content": text}]
        self.turns.pop(0)
        self.finish_reasons.append(finish_reason)
        self.new_tokens += new_tokens

    def stop(self, reason: str) -> None:
        self.finish_reasons.append(reason)
        self.turns = []

    def record(self, target: str) -> dict:
        return {
            "id": self.id,
            "messages": self.messages,
            "target": target,
            "finish_reason": self.finish_reasons[-1] if self.finish_reasons else "stop",
            "new_tokens": self.new_tokens,
            "finish_reasons": self.finish_reasons,
        }


def split_turns(conv, single_turn: bool = False) -> _Convo:
    """Keep leading system messages; every user message (and follow-up) becomes a turn to ask;
    assistant messages are dropped (the target writes its own)."""
    messages = conv.messages if hasattr(conv, "messages") else conv["messages"]
    followups = list(getattr(conv, "followups", None) or (conv.get("followups", []) if isinstance(conv, dict) else []))
    cid = conv.id if hasattr(conv, "id") else conv["id"]
    system = []
    turns: list[str] = []
    for m in messages:
        if m["role"] == "system" and not turns:
            system.append({"role": "system", "content": m["content"]})
        elif m["role"] == "user":
            turns.append(m["content"])
    turns += followups
    if single_turn:
        turns = turns[:1]
    return _Convo(str(cid), system, turns)


def pending_conversations(conversations: Sequence, out_path: str | Path, single_turn: bool = False
                          ) -> tuple[list[_Convo], int]:
    """Repair `out_path` (drop a torn last line) and return (conversations still to answer,
    number already finished)."""
    done = {str(r.get("id")) for r in repair_jsonl(out_path)}
    todo, seen, skipped = [], set(), 0
    for c in conversations:
        cv = split_turns(c, single_turn)
        if cv.id in done:
            skipped += 1
        elif cv.id not in seen and cv.turns:
            seen.add(cv.id)
            todo.append(cv)
    return todo, skipped


# -- in-process generation -----------------------------------------------------------------


def generate_batch(target, prompts: Sequence[Sequence[int]], cfg: RegenConfig, decoder=None
                   ) -> list[tuple[list[int], str]]:
    """Batched plain decoding of a left-padded batch: with `decoder` (a BatchDecoder) where the
    sequences fit it, else HF `generate`; greedy, or sampled under cfg's temperature and top-p.

    Returns, per prompt, (new token ids up to and including the first eos, finish reason).
    """
    import torch
    from transformers import GenerationConfig

    eos = list(target.eos_token_ids)
    tok = target.tokenizer
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (eos[0] if eos else 0)
    if decoder is not None and decoder.fits(max(map(len, prompts)) + cfg.max_new_tokens):
        from ..engine.api import SamplingParams

        rule = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p)
        return decoder.generate([list(p) for p in prompts], cfg.max_new_tokens, eos, pad, sampling=rule)
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, T), pad, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, T - len(p):] = 1
    sampling = cfg.temperature > 0
    gc = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=sampling,
        temperature=cfg.temperature if sampling else None,
        top_p=cfg.top_p if sampling else None,
        top_k=None,
        eos_token_id=eos or None,
        pad_token_id=pad,
    )
    dev = target.device
    if dev.type == "cpu":
        # A preallocated cache: the default one concatenates every layer's KV at every step, which
        # was half of a CPU decode step (1.6x faster decoding, identical tokens, measured).
        gc.cache_implementation = "static"
    with torch.no_grad():
        out = target.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=gc)
    new = out[:, T:].tolist()
    stops = set(eos)
    results = []
    for row in new:
        cut = next((i for i, t in enumerate(row) if t in stops), None)
        if cut is None:
            results.append((row, "length"))
        else:
            results.append((row[: cut + 1], "stop"))
    return results


def regenerate_local(
    target,
    conversations: Sequence,
    out_path: str | Path,
    cfg: RegenConfig | None = None,
    *,
    batch_size: int = 8,
    progress: bool = True,
    fast: bool | None = None,
) -> RegenSummary:
    """Answer `conversations` with the in-process target and append records to `out_path`.

    `fast` (None: wherever it applies) decodes batches with BatchDecoder instead of HF
    `generate`."""
    import torch

    from .chat import prompt_ids

    cfg = cfg or RegenConfig()
    tok = target.tokenizer
    if tok is None:
        raise SpecdecError("the target has no tokenizer; regenerate renders prompts with its chat template")
    todo, skipped = pending_conversations(conversations, out_path, cfg.single_turn)
    summary = RegenSummary(skipped_done=skipped, total=skipped + len(todo))
    decoder = batch_decoder(target) if fast is not False and todo else None
    if fast and decoder is None and todo:
        raise SpecdecError(f"the batch decoder does not apply here: {batch_decoder_blocker(target)}")
    if todo and progress:
        log(f"decoding with {_decoder_name(target, decoder, fast)}")
    if cfg.temperature > 0:
        torch.manual_seed(cfg.seed)
    max_len = getattr(target.config, "max_position_embeddings", None) or 1 << 30
    eos = set(target.eos_token_ids)
    # Longest first: turn count, then first prompt length.
    first = {c.id: len(prompt_ids(tok, c.ask())) for c in todo}
    todo.sort(key=lambda c: (len(c.turns), first[c.id]), reverse=True)
    name = str(target.name)
    t0 = time.perf_counter()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "a", encoding="utf-8") as f, _progress(progress) as prog:
        task = prog.add_task("regenerating", total=summary.total, completed=skipped, rate="")
        for g in range(0, len(todo), batch_size):
            group = todo[g : g + batch_size]
            while True:
                active = [c for c in group if not c.done]
                if not active:
                    break
                asks = []
                for c in active:
                    ids = prompt_ids(tok, c.ask())
                    if len(ids) + cfg.max_new_tokens > max_len:
                        c.stop("prompt_too_long")
                    else:
                        asks.append((c, ids))
                if not asks:
                    continue
                asks.sort(key=lambda a: len(a[1]))
                try:
                    outs = generate_batch(target, [a[1] for a in asks], cfg, decoder)
                except torch.OutOfMemoryError as e:
                    # Longest prompts come first, so this is the first batch or close to it.
                    longest = max(len(a[1]) for a in asks)
                    raise SpecdecError(
                        f"out of memory decoding {len(asks)} conversations of up to {longest} prompt tokens "
                        f"+ {cfg.max_new_tokens} new ones ({summary.conversations:,} finished and kept in "
                        f"{out_path}); rerun with a smaller --batch-size (now {batch_size}) to resume") from e
                for (c, _), (new, reason) in zip(asks, outs):
                    body = new[:-1] if new and new[-1] in eos else new
                    c.answer(tok.decode(body, skip_special_tokens=True), reason, len(new))
                    summary.new_tokens += len(new)
                el = time.perf_counter() - t0
                prog.update(task, rate=_rate(summary.new_tokens, summary.conversations, el))
            for c in group:
                rec = c.record(name)
                append_jsonl(f, rec)
                summary.conversations += 1
                summary.finish_reasons[rec["finish_reason"]] = summary.finish_reasons.get(rec["finish_reason"], 0) + 1
            el = time.perf_counter() - t0
            prog.update(task, advance=len(group), rate=_rate(summary.new_tokens, summary.conversations, el))
    summary.seconds = time.perf_counter() - t0
    return summary


def batch_decoder_blocker(target) -> str | None:
    """Why BatchDecoder cannot answer for `target` (None: it can)."""
    from ..engine.static_layers import check_supported

    if getattr(target.model, "hf_device_map", None) and len(set(target.model.hf_device_map.values())) > 1:
        return "the target is split over devices (--device-map)"
    try:
        check_supported(target.config)
    except SpecdecError as e:
        return str(e)
    return None


def _decoder_name(target, decoder, fast: bool | None) -> str:
    if decoder is not None:
        return "the batch decoder (static cache" + (", CUDA graphs)" if target.device.type == "cuda" else ")")
    return "HF generate (" + ("--hf-generate" if fast is False else batch_decoder_blocker(target)) + ")"


def batch_decoder(target):
    """A BatchDecoder over the target's weights, or None where it does not apply (see
    batch_decoder_blocker)."""
    if batch_decoder_blocker(target) is not None:
        return None
    from ..engine.batch import BatchDecoder

    return BatchDecoder(target.model)


def _rate(tokens: int, convs: int, seconds: float) -> str:
    if seconds <= 0:
        return ""
    return f"{tokens / seconds:,.0f} tok/s {convs / seconds:.2f} conv/s"


# -- OpenAI-compatible endpoint ------------------------------------------------------------


def chat_url(endpoint: str) -> str:
    """Accept http://host:port, .../v1 or the full .../v1/chat/completions."""
    e = endpoint.rstrip("/")
    if e.endswith("/chat/completions"):
        return e
    if e.endswith("/v1"):
        return e + "/chat/completions"
    return e + "/v1/chat/completions"


class EndpointError(SpecdecError):
    pass


class _Rejected(Exception):
    """The server refused this request for good (4xx other than 408/409/429)."""


RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


async def _post(client, url: str, body: dict, headers: dict, *, max_retries: int, retry_base_s: float) -> dict:
    import httpx

    last = ""
    for attempt in range(max_retries + 1):
        wait = None
        try:
            r = await client.post(url, json=body, headers=headers)
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code not in RETRY_STATUS and r.status_code < 500:
                raise _Rejected(last)
            ra = r.headers.get("retry-after")
            if ra:
                try:
                    wait = min(60.0, float(ra))
                except ValueError:
                    wait = None
        except httpx.TransportError as e:  # connect errors, timeouts, dropped connections
            last = f"{type(e).__name__}: {e}"
        if attempt < max_retries:
            # Full jitter keeps many workers from retrying in lockstep.
            await asyncio.sleep(wait if wait is not None else random.uniform(0, min(30.0, retry_base_s * 2 ** attempt)))
    raise EndpointError(f"{url} failed {max_retries + 1} times, last: {last}; check that the server is up "
                        f"(curl {url.rsplit('/chat/completions', 1)[0]}/models) and rerun: finished "
                        f"conversations are kept")


async def _first_model(client, endpoint: str, headers: dict) -> str:
    url = chat_url(endpoint).rsplit("/chat/completions", 1)[0] + "/models"
    try:
        r = await client.get(url, headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as e:
        raise EndpointError(f"could not list models at {url} ({type(e).__name__}: {e}); pass --model NAME") from e


async def _regenerate_endpoint(endpoint, conversations, out_path, cfg, model, concurrency, api_key,
                               max_retries, retry_base_s, timeout_s, progress, count_tokens) -> RegenSummary:
    import httpx

    todo, skipped = pending_conversations(conversations, out_path, cfg.single_turn)
    summary = RegenSummary(skipped_done=skipped, total=skipped + len(todo))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = chat_url(endpoint)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    t0 = time.perf_counter()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if not model:
            model = await _first_model(client, endpoint, headers)
        sem = asyncio.Semaphore(concurrency)

        async def answer(c: _Convo) -> _Convo:
            async with sem:  # one slot per conversation, so conversations finish (and are saved) in turn
                while not c.done:
                    body = {"model": model, "messages": c.ask(), "max_tokens": cfg.max_new_tokens,
                            "temperature": cfg.temperature, "top_p": cfg.top_p if cfg.temperature > 0 else 1.0}
                    if cfg.temperature > 0:
                        body["seed"] = cfg.seed
                    try:
                        resp = await _post(client, url, body, headers, max_retries=max_retries,
                                           retry_base_s=retry_base_s)
                    except _Rejected as e:
                        c.stop("rejected")
                        c.error = str(e)
                        break
                    choice = resp["choices"][0]
                    text = (choice.get("message") or {}).get("content") or ""
                    usage = resp.get("usage") or {}
                    n = usage.get("completion_tokens")
                    if n is None:
                        n = count_tokens(text)
                    c.answer(text, choice.get("finish_reason") or "stop", int(n))
            return c

        with open(out_path, "a", encoding="utf-8") as f, _progress(progress) as prog:
            task = prog.add_task("regenerating", total=summary.total, completed=skipped, rate="")
            tasks = [asyncio.create_task(answer(c)) for c in todo]
            try:
                for fut in asyncio.as_completed(tasks):
                    c = await fut
                    rec = c.record(model)
                    if c.error:
                        rec["error"] = c.error
                    append_jsonl(f, rec)
                    summary.conversations += 1
                    summary.new_tokens += c.new_tokens
                    summary.finish_reasons[rec["finish_reason"]] = (
                        summary.finish_reasons.get(rec["finish_reason"], 0) + 1
                    )
                    el = time.perf_counter() - t0
                    prog.update(task, advance=1, rate=_rate(summary.new_tokens, summary.conversations, el))
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    summary.seconds = time.perf_counter() - t0
    return summary


def regenerate_endpoint(
    endpoint: str,
    conversations: Sequence,
    out_path: str | Path,
    cfg: RegenConfig | None = None,
    *,
    model: str | None = None,
    concurrency: int = 8,
    api_key: str | None = None,
    max_retries: int = 6,
    retry_base_s: float = 0.5,
    timeout_s: float = 600.0,
    progress: bool = True,
    count_tokens: Callable[[str], int] | None = None,
) -> RegenSummary:
    """Answer `conversations` through an OpenAI-compatible /v1/chat/completions endpoint.

    `model`: the served model name (default: the first of GET /v1/models). `count_tokens` is
    used only when the server reports no usage (default: 0 tokens counted).
    """
    if concurrency < 1:
        raise SpecdecError(f"--concurrency must be >= 1, found {concurrency}")
    return asyncio.run(_regenerate_endpoint(
        endpoint, conversations, out_path, cfg or RegenConfig(), model, concurrency, api_key,
        max_retries, retry_base_s, timeout_s, progress, count_tokens or (lambda s: 0)))


def _progress(enabled: bool):
    from ..progress import progress_bar

    return progress_bar(enabled=enabled)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
