"""`specdec serve`: an OpenAI-compatible server on specdec's own speculative engine, with vLLM's
/metrics names so `specdec diagnose`, Prometheus and Grafana read it like a vLLM server."""

from __future__ import annotations

import argparse
import os

from ._engine_args import add_engine_args

DESCRIPTION = """\
Serve a target model with speculative decoding behind an OpenAI-compatible API:
/v1/chat/completions and /v1/completions (streaming and not), /v1/models, /health, and /metrics
with vLLM's counter names (vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
_num_accepted_tokens_per_pos, ...), so `specdec diagnose URL/metrics` judges it like vLLM.

Drafting: --drafter DIR (an EAGLE-3 drafter in eagle3 or speculators format; chain of
--num-speculative-tokens, or a tree with --tree-depth/--tree-top-k/--tree-tokens), --ngram N
(prompt lookup, no drafter), or neither (plain decoding: the baseline to compare against).

Engine: the fast path (static KV cache, CUDA graphs; compiled and captured at start-up) on a
CUDA GPU and for bf16 targets of 50M+ parameters on a CPU, else the reference engine; the banner
says which, --reference asks for the reference engine.

Scheduling: FIFO, one sequence at a time. Requests queue in arrival order and a single engine
worker generates them one after another (the engine is batch-1), so under concurrent load a
request waits for every request ahead of it (see vllm:num_requests_waiting). The queue is bounded
(--max-waiting: one more gets 429 with Retry-After) and so is the wait (--queue-timeout: 503); a
request whose client leaves while waiting never runs. A client that disconnects cancels its
running request within one engine step (one target forward pass); stop strings end it the same
way. SIGTERM drains: nothing new is accepted, waiting requests get 503, the running one may finish
within --drain-timeout.

Limits: request body --max-body-mb (413); prompt + max_tokens within --max-model-len (400
context_length_exceeded; text over 64 characters per context token is refused before tokenizing);
at most 4 stop strings of up to 1,000 characters; seed within 64 bits; n = 1.

Binds 127.0.0.1 unless --host says otherwise; use --api-key (or SPECDEC_API_KEY) before
exposing it: /v1/* then require `Authorization: Bearer KEY` (/health and /metrics stay open, as in
vLLM; --protect-metrics guards /metrics and /openapi.json with the key too).

examples:
  specdec serve --target tiny-llama --ngram 3 --port 8000            # CPU, seconds
  specdec serve --target smollm2-135m-instruct --ngram 3 --num-speculative-tokens 4
  specdec serve --target qwen2.5-coder-1.5b-instruct --drafter runs/eagle3/export --port 8000
  specdec serve --target ./my-target --drafter ./drafter --tree-depth 6 --tree-top-k 8 --tree-tokens 48
  specdec serve --target smollm2-135m-instruct --host 0.0.0.0 --api-key "$SPECDEC_API_KEY"

then:
  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'
  specdec diagnose http://127.0.0.1:8000/metrics
"""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible server with speculative decoding and vLLM-named /metrics",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(p, fast_path=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000; 0 = any free port)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"), metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $SPECDEC_API_KEY, else open)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="with --api-key, also require the key on /metrics and /openapi.json (for a server bound "
                        "beyond localhost; give Prometheus the key as a bearer token); /health stays open")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="model name clients send and /metrics labels carry (default: the target's name)")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS",
                   help="context limit for prompt + completion (default: the target's max_position_embeddings; "
                        "on the fast path 2048, its static KV cache being allocated up front)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--max-waiting", type=int, default=64, metavar="N",
                   help="requests that may wait behind the running one; one more gets 429 with Retry-After "
                        "(default: 64)")
    p.add_argument("--queue-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="a request not started after this long gets 503 and never runs (default: 600)")
    p.add_argument("--max-body-mb", type=float, default=32.0, metavar="MB",
                   help="largest request body; a larger one gets 413, read no further (default: 32)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM: how long the running request may finish before it is ended cleanly; "
                        "waiting ones get 503 at once (default: 30)")
    p.add_argument("--fault", action="append", default=[], metavar="KIND=VALUE",
                   help="break the served drafter on purpose, to reproduce an integration fault for `doctor "
                        "--server` and demos: aux-ids=2,16,28 feeds the drafter those hidden states instead of "
                        "the ones it declares (a server capturing other layers); zero-aux=SLOT feeds zeros for "
                        "that aux state (vLLM once captured nothing for the last id of a DeepSeek target). "
                        "Repeatable; never for real serving")
    p.set_defaults(func=run)


def parse_faults(specs: list[str]):
    """`--fault` values -> a function that applies them to a loaded drafter (None without any)."""
    from specdec.errors import SpecdecError

    steps = []
    for spec in specs:
        kind, _, value = spec.partition("=")
        try:
            if kind == "aux-ids":
                ids = [int(x) for x in value.split(",")]
                steps.append(lambda d, ids=ids: setattr(d.cfg, "aux_layer_ids", ids))
            elif kind == "zero-aux":
                slot = int(value)
                steps.append(lambda d, slot=slot: _zero_aux(d, slot))
            else:
                raise ValueError
        except ValueError:
            raise SpecdecError(f"--fault {spec!r}: expected aux-ids=2,16,28 or zero-aux=SLOT") from None
    if not steps:
        return None

    def apply(drafter):
        for step in steps:
            step(drafter)
        states = drafter.fc.in_features // drafter.cfg.target_hidden_size
        if len(drafter.cfg.aux_layer_ids) != states:
            raise SpecdecError(f"--fault aux-ids: the drafter's fc reads {states} states; give as many ids")
    return apply


def _zero_aux(drafter, slot: int) -> None:
    import torch

    from specdec.doctor.sweep import zero_aux_slot
    from specdec.errors import SpecdecError

    if not 0 <= slot < len(drafter.cfg.aux_layer_ids):
        last = len(drafter.cfg.aux_layer_ids) - 1
        raise SpecdecError(f"--fault zero-aux={slot}: the drafter reads aux states 0..{last}")
    with torch.no_grad():
        zero_aux_slot(drafter, slot)


def _check_port_free(host: str, port: int) -> None:
    import socket

    from specdec.errors import SpecdecError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise SpecdecError(
                f"cannot bind {host}:{port} ({e.strerror}); another server is probably running there: "
                f"stop it or pass --port with a free port"
            ) from None


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def banner(*, host: str, port: int, model: str, mode: str, k: int, max_model_len: int, api_key: bool,
           engine: str = "reference") -> str:
    base = f"http://{_url_host(host)}:{port}"
    auth = ' -H "Authorization: Bearer $SPECDEC_API_KEY"' if api_key else ""
    quoted = model.replace('"', '\\"').replace("'", "'\\''")  # inside JSON inside single quotes
    body = '{"model": "%s", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}' % quoted
    drafting = mode if mode == "plain" else f"{mode}, k={k}"
    lines = [
        f"specdec serve: ready on {base}  (FIFO, one sequence at a time)",
        f"  model     {model}  ({drafting}, max model len {max_model_len}, {engine} engine)",
        f"  api       {base}/v1" + ("  (API key required)" if api_key else ""),
        f"  try       curl -s {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
        f"  metrics   curl -s {base}/metrics | grep spec_decode",
        f"  diagnose  specdec diagnose {base}/metrics",
    ]
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        lines.append(f"  warning   bound to {host} without --api-key: anyone who can reach this port can use it")
    return "\n".join(lines)


def run(args) -> int:
    import sys

    from specdec.errors import SpecdecError

    from ._engine_args import build_engine, tree_config

    tree = tree_config(args)  # flag errors before the port check and the model load
    fault = parse_faults(args.fault)
    if args.max_model_len is not None and args.max_model_len < 1:
        raise SpecdecError(f"--max-model-len must be at least 1, got {args.max_model_len}")
    if not 0 <= args.port <= 65535:
        raise SpecdecError(f"--port must be 0..65535, got {args.port}")
    if args.protect_metrics and not args.api_key:
        raise SpecdecError("--protect-metrics guards /metrics with the API key: give --api-key (or SPECDEC_API_KEY)")
    for flag, value, zero_ok in (("--max-waiting", args.max_waiting, True),
                                 ("--queue-timeout", args.queue_timeout, False),
                                 ("--max-body-mb", args.max_body_mb, False),
                                 ("--drain-timeout", args.drain_timeout, True)):
        if not (value >= 0 if zero_ok else value > 0):  # NaN fails both
            raise SpecdecError(f"{flag} must be {'at least 0' if zero_ok else 'above 0'}, got {value}")
    _check_port_free(args.host, args.port)  # fail before a model load that may take minutes

    import uvicorn

    from specdec.engine.api import SamplingParams
    from specdec.engine.choice import engine_kind
    from specdec.server.app import ServeSettings, create_app

    print(f"specdec serve: loading {args.target}" + (f" + drafter {args.drafter}" if args.drafter else ""),
          file=sys.stderr, flush=True)
    target, engine = build_engine(args, max_len=args.max_model_len, fault=fault)
    if fault is not None:
        print(f"specdec serve: FAULT INJECTED ({', '.join(args.fault)}): the drafter is served wrong on purpose",
              file=sys.stderr, flush=True)
    max_len = args.max_model_len or engine.max_len
    if max_len > engine.max_len:
        raise SpecdecError(
            f"--max-model-len {max_len} exceeds the target's context of {engine.max_len} tokens "
            f"(max_position_embeddings); pass at most {engine.max_len}"
        )
    if target.tokenizer is None:
        raise SpecdecError(f"{args.target} has no tokenizer; expected tokenizer files next to the weights")
    if engine_kind(engine) == "fast":
        # Every step size compiled (and on a GPU captured) now, in this thread, not on a request's time.
        print("specdec serve: compiling the fast path's steps (--reference skips this)", file=sys.stderr, flush=True)
        engine.warmup()
    # One short generation so the first request does not pay for lazy initialisation.
    first = target.tokenizer("Hello", add_special_tokens=False)["input_ids"][:1] or [0]
    engine.generate(list(first), SamplingParams(max_new_tokens=2, temperature=0.0))

    name = args.served_model_name or target.name
    settings = ServeSettings(served_model_name=name, max_model_len=max_len, api_key=args.api_key or None,
                             max_body_bytes=int(args.max_body_mb * (1 << 20)), max_waiting=args.max_waiting,
                             queue_timeout=args.queue_timeout, protect_metrics=args.protect_metrics)
    app = create_app(engine, target.tokenizer, settings)
    shown_k = tree.depth if tree is not None else args.k

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.started:
                return
            port = args.port
            try:  # --port 0: report the port the OS picked
                port = self.servers[0].sockets[0].getsockname()[1]
            except (AttributeError, IndexError):
                pass
            print(banner(host=args.host, port=port, model=name, mode=engine.mode, k=shown_k,
                         max_model_len=max_len, api_key=bool(settings.api_key),
                         engine=engine_kind(engine)), flush=True)

        def handle_exit(self, sig, frame):
            # SIGTERM/SIGINT: the scheduler refuses new work and ends what waits at once; uvicorn
            # stops accepting connections and waits for the running request (cut at the drain timeout).
            if not self.should_exit:
                print(f"specdec serve: draining (up to {args.drain_timeout:g} s for the running request)",
                      file=sys.stderr, flush=True)
                app.state.scheduler.drain(args.drain_timeout)
            super().handle_exit(sig, frame)

    # uvicorn cancels what still runs after its own timeout: give the drain its time and a margin.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            access_log=args.access_log, timeout_graceful_shutdown=args.drain_timeout + 5)
    _Server(config).run()
    return 0
