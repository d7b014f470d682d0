"""The FastAPI app behind `specdec serve`: OpenAI-compatible /v1/chat/completions,
/v1/completions and /v1/models, plus /health and a vLLM-named /metrics.

Every request is validated here, in the event loop, before it reaches the single engine worker
(`scheduler.py` documents the FIFO scheduling and cancellation). Every refusal carries OpenAI's
error body, {"error": {"message", "type", "param", "code"}}, and never disturbs the worker:

    malformed JSON, wrong types, bad values, n != 1 ....... 400 invalid_request_error
      (also: text that is not valid Unicode, JSON nested deeper than 64, integers beyond
      64 bits, more than 4 stop strings or one over 1,000 characters)
    prompt + max_tokens longer than the context ......... 400 code context_length_exceeded
      (text over 64 characters per context token is refused before it is tokenized)
    missing or wrong API key (--api-key) on /v1/* ....... 401 code invalid_api_key
    unknown model ....................................... 404 code model_not_found
    request body over the limit (--max-body-mb) ......... 413 code request_too_large, read no further
    the queue is full (--max-waiting) ................... 429 code queue_full, with Retry-After
    an engine failure ................................... 500 server_error (that request only)
    waited past --queue-timeout, or shutting down ....... 503 code queue_timeout / shutting_down

Tokenization runs in a worker thread, never on the event loop, so a long prompt does not stall
/health or other streams. A streaming response starts (200 and its first chunk) only when the
engine takes the request, so queueing outcomes are real HTTP statuses for streams too.

Chat prompts are rendered with `specdec.data.chat.render_text` (the tokenizer's own chat template,
the same function training data goes through) and encoded without adding special tokens again;
completion prompts are encoded with the tokenizer's special tokens, as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine.api import SamplingParams
from ..errors import SpecdecError
from .metrics import ServerMetrics
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
    new_id,
    now,
)
from .scheduler import Event, Job, QueueFull, Scheduler, ShuttingDown

DISCONNECT_POLL_S = 0.1  # how often a waiting request checks its client and its queue deadline
MAX_JSON_DEPTH = 64
MAX_CHARS_PER_TOKEN = 64  # text longer than this many characters per context token cannot fit
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")

    def response(self, headers: dict | None = None) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers={**(self.headers or {}),
                                                                                  **(headers or {})})


@dataclass(kw_only=True)
class ServeSettings:
    served_model_name: str
    max_model_len: int
    api_key: str | None = None
    default_temperature: float = 1.0  # OpenAI's default
    max_body_bytes: int = 32 << 20
    max_waiting: int = 64  # requests queued behind the running one; one more gets a 429
    queue_timeout: float = 600.0  # seconds a request may wait before it gets a 503
    protect_metrics: bool = False  # /metrics and /openapi.json need the API key too


def create_app(engine, tokenizer, settings: ServeSettings) -> FastAPI:
    """An app serving `engine` (a SpeculativeEngine, or anything with `generate_iter`)."""
    tree = getattr(engine, "tree", None)
    k = getattr(engine, "k", 0) if getattr(engine, "proposer", None) is not None else 0
    positions = tree.depth if tree is not None and engine.mode.endswith("tree") else k
    metrics = ServerMetrics(settings.served_model_name, positions=positions,
                            mode=getattr(engine, "mode", "unknown"), k=positions, version=__version__)
    scheduler = Scheduler(engine, tokenizer, metrics, max_waiting=settings.max_waiting,
                          queue_timeout=settings.queue_timeout)
    vocab_size = getattr(getattr(engine, "target", None), "vocab_size", None)
    created = now()

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="specdec serve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics
    app.state.scheduler = scheduler
    app.state.settings = settings

    # -- errors ---------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response({"WWW-Authenticate": "Bearer"} if exc.status == 401 else None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return _from_validation(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return APIError(exc.status_code, msg, code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    # -- open endpoints (as in vLLM: Prometheus scrapes /metrics without a key) ---------------
    if settings.protect_metrics and settings.api_key:
        @app.middleware("http")
        async def guard(request: Request, call_next):
            if request.url.path in ("/metrics", "/openapi.json"):
                try:
                    await check_api_key(request)
                except APIError as e:
                    return e.response({"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    # -- /v1 ------------------------------------------------------------------------------
    async def check_api_key(request: Request):
        if settings.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send the header `Authorization: Bearer <key>` "
                                "with the key given to `specdec serve --api-key`", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models", response_model=ModelList, responses=_errors(401))
    async def models():
        card = ModelCard(id=settings.served_model_name, created=created, max_model_len=settings.max_model_len,
                         root=getattr(getattr(engine, "target", None), "name", None))
        return ModelList(data=[card]).model_dump()

    async def tokenize(fn, *a) -> list[int]:
        def run():
            with scheduler.tokenizer_lock:
                return fn(*a)

        return await asyncio.to_thread(run)

    async def start(prompt_ids: list[int], req, params, request: Request) -> Job:
        try:
            job = scheduler.submit(prompt_ids, params, req.stop_strings())
        except QueueFull as e:
            raise APIError(429, f"{e}; retry after about {e.retry_after} s (the server generates one "
                                f"sequence at a time; --max-waiting sets the queue's length)", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down; retry on another replica or after the restart",
                           code="shutting_down") from None
        await _wait_started(job, request, scheduler)
        return job

    @v1.post("/chat/completions", response_model=ChatCompletionResponse, responses=POST_RESPONSES)
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest, settings.max_body_bytes)
        _check_common(req, settings)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        _check_chars(sum(len(m["content"]) for m in messages), settings, "messages")
        prompt_ids = await tokenize(_render_chat, tokenizer, messages)
        params = _sampling(req, len(prompt_ids), settings, default_max=None)
        job = await start(prompt_ids, req, params, request)
        rid = new_id("chatcmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream_chat(job, rid, settings.served_model_name, include_usage),
                                     media_type="text/event-stream", headers=SSE_HEADERS,
                                     background=BackgroundTask(job.cancel))
        text, last = await _collect(job, request)
        return ChatCompletionResponse(
            id=rid, created=now(), model=settings.served_model_name, usage=_usage(last),
            choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=last.finish_reason)],
        ).model_dump()

    @v1.post("/completions", response_model=CompletionResponse, responses=POST_RESPONSES)
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest, settings.max_body_bytes)
        _check_common(req, settings)
        if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], str)):
            _check_chars(sum(map(len, [req.prompt] if isinstance(req.prompt, str) else req.prompt)), settings,
                         "prompt")
        prompt_ids = await tokenize(_encode_prompt, tokenizer, req.prompt, vocab_size)
        params = _sampling(req, len(prompt_ids), settings, default_max=16)
        job = await start(prompt_ids, req, params, request)
        rid = new_id("cmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream_completion(job, rid, settings.served_model_name, include_usage),
                                     media_type="text/event-stream", headers=SSE_HEADERS,
                                     background=BackgroundTask(job.cancel))
        text, last = await _collect(job, request)
        return CompletionResponse(
            id=rid, created=now(), model=settings.served_model_name, usage=_usage(last),
            choices=[CompletionChoice(text=text, finish_reason=last.finish_reason)],
        ).model_dump()

    app.include_router(v1)
    _document_bodies(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest})
    return app


def _errors(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse} for s in statuses}


# One server-sent event of a stream (`stream: true`): before OpenAPI 3.2, a text/event-stream
# response's `schema` describes each event, not the stream as one string. Each carries a JSON
# chunk, or "[DONE]", as its data.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}

# What a /v1 POST may answer, as the OpenAPI schema states it (schemathesis holds the server to it).
POST_RESPONSES = {**_errors(400, 401, 404, 413, 429, 499, 500, 503),
                  200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}}}


def _document_bodies(app: FastAPI, bodies: dict) -> None:
    """The request models in /openapi.json: the routes parse their bodies themselves (`_parse`:
    a size limit while reading, then checks no model can express), so FastAPI cannot see them."""
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# -- request handling -----------------------------------------------------------------------


async def _parse(request: Request, model, limit: int):
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {int(length)} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body is refused as soon as it passes the limit
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, a 5,000-digit integer
        raise APIError(400, f"the request body is not valid JSON ({type(e).__name__}: {str(e)[:200]}); expected "
                            f"a JSON object", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"expected a JSON object as the request body, got {type(data).__name__}",
                       code="invalid_json")
    _check_json(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _from_validation(e.errors()) from None


def _check_json(data) -> None:
    """Refuse what no tokenizer or engine should see: nesting beyond MAX_JSON_DEPTH, and strings
    that are not valid Unicode (a lone surrogate such as "\\ud800" decodes, but encodes nowhere)."""
    todo = [(data, 1, "")]
    while todo:
        value, depth, where = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request nests JSON deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        if isinstance(value, dict):
            todo.extend((v, depth + 1, f"{where}.{k}" if where else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            todo.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"{where or 'body'}: the text is not valid Unicode ({e.reason} at character "
                                    f"{e.start}); send UTF-8 text", param=where or None,
                               code="invalid_value") from None


def _check_chars(chars: int, settings: ServeSettings, param: str) -> None:
    limit = settings.max_model_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise APIError(400, f"the {param} have {chars} characters, more than a context of {settings.max_model_len} "
                            f"tokens can hold (at most {limit}); shorten the prompt", param=param,
                       code="context_length_exceeded")


async def _wait_started(job: Job, request: Request, scheduler) -> None:
    """Until the engine takes the job: a client that goes away, or a wait past the queue timeout,
    ends it without running; an error it ended with (shutdown) becomes this request's."""
    while not job.started.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(job.woken.wait(), DISCONNECT_POLL_S)
        if job.started.is_set():
            break
        if scheduler.expired(job):
            job.cancel(f"waited {scheduler.queue_timeout:g} s in the queue without starting (--queue-timeout); "
                       f"retry later", "queue_timeout")
        elif not job.started.is_set() and await request.is_disconnected():
            job.cancel()
            raise APIError(499, "client disconnected", code="client_disconnected")
    if job.dropped is not None and job.dropped.error:
        raise APIError(job.dropped.status, job.dropped.error, code=job.dropped.code)


def _from_validation(errors) -> APIError:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    got = first.get("input")
    got_s = "" if first.get("type") == "missing" else f" (got {json.dumps(got, default=str)[:80]})"
    more = f"; and {len(errors) - 1} more problem(s)" if len(errors) > 1 else ""
    return APIError(400, f"{param or 'request'}: {first.get('msg', 'invalid')}{got_s}{more}", param=param,
                    code="invalid_value")


def _check_common(req, settings: ServeSettings) -> None:
    if req.model is not None and req.model != settings.served_model_name:
        raise APIError(404, f"the model `{req.model}` does not exist; this server serves "
                            f"`{settings.served_model_name}` (GET /v1/models)", param="model", code="model_not_found")
    bad = req.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0], code="unsupported")


def _sampling(req, prompt_len: int, settings: ServeSettings, *, default_max: int | None) -> SamplingParams:
    limit = settings.max_model_len
    param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    requested = req.requested_max_tokens()
    if requested is not None and requested < 1:
        raise APIError(400, f"{param} must be at least 1, got {requested}", param=param, code="invalid_value")
    if requested is not None and requested >= limit:
        raise APIError(400, f"{param}={requested} does not fit the model's context of {limit} tokens "
                            f"(prompt included)", param=param, code="context_length_exceeded")
    if prompt_len >= limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                            f"{prompt_len} tokens; shorten the prompt", param="messages"
                       if hasattr(req, "messages") else "prompt", code="context_length_exceeded")
    if requested is None:
        requested = min(default_max or limit, limit - prompt_len)
    if prompt_len + requested > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, but {prompt_len + requested} "
                            f"were requested ({prompt_len} in the prompt, {requested} in the completion); "
                            f"reduce the prompt or {param}", param=param, code="context_length_exceeded")
    temperature = settings.default_temperature if req.temperature is None else req.temperature
    return SamplingParams(max_new_tokens=requested, temperature=temperature,
                          top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, ignore_eos=req.ignore_eos)


def _render_chat(tokenizer, messages: list[dict]) -> list[int]:
    from ..data.chat import render_text

    try:
        text = render_text(tokenizer, messages, add_generation_prompt=True)
    except SpecdecError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None
    # The template already placed BOS and the role markers: do not add special tokens twice.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_prompt(tokenizer, prompt, vocab_size: int | None) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"]) if prompt else []
    else:
        ids = list(prompt)
        bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary 0..{(vocab_size or 1) - 1}",
                           param="prompt", code="invalid_value")
    if not ids:
        raise APIError(400, "the prompt is empty: expected at least one token", param="prompt", code="invalid_value")
    return ids


def _usage(ev: Event) -> Usage:
    return Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                 total_tokens=ev.prompt_tokens + ev.completion_tokens)


async def _collect(job: Job, request: Request) -> tuple[str, Event]:
    """Wait for a non-streaming request, cancelling it if its client goes away."""
    parts: list[str] = []
    getter = None  # one pending get() at a time, never cancelled mid-flight (no lost events)
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(job.events.get())
            done, _ = await asyncio.wait({getter}, timeout=max(0.0, next_check - loop.time()))
            # Checked on a clock, not only when idle: a generating request sends events every step.
            if loop.time() >= next_check:
                next_check = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    job.cancel()
                    raise APIError(499, "client disconnected", code="client_disconnected")
            if not done:
                continue
            ev, getter = getter.result(), None
            parts.append(ev.text)
            if ev.finished:
                if ev.error:
                    raise _failure(ev)
                return "".join(parts), ev
    except asyncio.CancelledError:
        job.cancel()
        raise
    finally:
        if getter is not None:
            getter.cancel()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(job: Job):
    """The job's events until it finishes; cancels the job when the consumer goes away."""
    try:
        while True:
            ev = await job.events.get()
            yield ev
            if ev.finished:
                return
    finally:
        job.cancel()  # no-op once finished; otherwise the client is gone (disconnect or error)


def _failure(ev: Event) -> APIError:
    return APIError(ev.status, ev.error if ev.status != 500 else f"generation failed: {ev.error}", code=ev.code)


def _stream_error(ev: Event) -> dict:
    e = _failure(ev)
    return {"error": {"message": e.message, "type": e.type, "param": None, "code": e.code}}


async def _stream_chat(job: Job, rid: str, model: str, include_usage: bool):
    created = now()

    def chunk(delta: dict, finish_reason=None) -> dict:
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
        if include_usage:
            out["usage"] = None
        return out

    yield _sse(chunk({"role": "assistant", "content": ""}))
    async for ev in _events(job):
        if ev.error:
            yield _sse(_stream_error(ev))
            break
        if ev.text:
            yield _sse(chunk({"content": ev.text}))
        if ev.finished:
            yield _sse(chunk({}, ev.finish_reason))
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(ev).model_dump()})
    yield "data: [DONE]\n\n"


async def _stream_completion(job: Job, rid: str, model: str, include_usage: bool):
    created = now()

    def chunk(text: str, finish_reason=None) -> dict:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}
        if include_usage:
            out["usage"] = None
        return out

    async for ev in _events(job):
        if ev.error:
            yield _sse(_stream_error(ev))
            break
        if ev.finished:
            yield _sse(chunk(ev.text, ev.finish_reason))
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(ev).model_dump()})
        elif ev.text:
            yield _sse(chunk(ev.text))
    yield "data: [DONE]\n\n"
