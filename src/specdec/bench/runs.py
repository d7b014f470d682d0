"""Benchmark runs: the same prompts through HF generate, HF prompt lookup and specdec's engines,
in one process, so every ratio compares figures taken minutes apart on the same machine.

Methods (rows of the table, in order):
    hf-generate          model.generate, greedy (HF's own baseline)
    hf-prompt-lookup     model.generate(prompt_lookup_num_tokens=...)
    hf-assisted          model.generate(assistant_model=...) (with an assistant model: HF's
                         assisted generation, the classic draft-model baseline)
    specdec-plain        our engine, no drafts (the fast path on a CUDA GPU, else the reference)
    specdec-ngram        prompt lookup in our engine
    specdec-eagle3-k{k}  EAGLE-3 chain of k drafts (with a drafter)
    specdec-eagle3-tree  EAGLE-3 dynamic tree (with a drafter)
Every specdec row is checked token for token against specdec-plain (greedy is lossless), and
hf-generate against specdec-plain too (same math, different kernels: bf16 ties can flip).

Examples:
    from specdec.bench.runs import load_prompts, run_bench
    prompts = load_prompts("mt-bench", target.tokenizer, limit=10)
    result = run_bench(target, prompts, max_new_tokens=256)
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ..engine.api import SamplingParams
from ..engine.config import FastConfig
from ..errors import SpecdecError


@dataclass(kw_only=True)
class Row:
    method: str
    engine: str  # "hf", "fast" or "reference"
    prompts: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    warmup_seconds: float = 0.0
    mean_acceptance_length: float | None = None
    acceptance_rate: float | None = None
    steps: int = 0  # target passes, the prefill's included (specdec rows)
    drafted_per_step: float | None = None  # draft tokens verified per step that drafted
    step_cost: float | None = None  # ms per step over specdec plain's ms per step
    cost_per_draft: float | None = None  # c: (step_cost - 1) / drafted_per_step
    identical_to_plain: int | None = None  # prompts whose tokens equal specdec-plain's
    common_prefix_frac: float | None = None  # mean shared-prefix length / plain's length
    error: str | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1e3 * self.seconds / self.new_tokens if self.new_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("outputs")
        d["tok_s"] = self.tok_s
        d["ms_per_token"] = self.ms_per_token
        return d


# -- prompts ---------------------------------------------------------------------------------------


def _messages_of(rec: dict) -> list[dict] | None:
    if "messages" in rec:
        return rec["messages"]
    if "turns" in rec:  # MT-Bench question.jsonl
        return [{"role": "user", "content": rec["turns"][0]}]
    if "prompt" in rec:
        return [{"role": "user", "content": rec["prompt"]}]
    if "conversations" in rec:
        role = {"human": "user", "gpt": "assistant", "system": "system"}
        msgs = [{"role": role.get(m["from"], m["from"]), "content": m["value"]} for m in rec["conversations"]]
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        return msgs or None
    return None


def _read_records(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_messages(source: str, limit: int | None = None) -> list[list[dict]]:
    """Chat prompts from a local .json/.jsonl(.gz) file (MT-Bench question, ShareGPT, OpenAI
    messages or {"prompt"} records) or a built-in set name (mt-bench, humaneval, sharegpt)."""
    p = Path(source).expanduser()
    if p.is_file():
        convs = [m for m in (_messages_of(r) for r in _read_records(p)) if m]
    else:
        try:
            from ..data.datasets import load_conversations
        except ImportError as e:
            raise SpecdecError(f"no such prompt file {source!r} and no built-in prompt sets here ({e})") from e
        convs = [c.messages for c in load_conversations(source)]
    if not convs:
        raise SpecdecError(f"no prompts found in {source}")
    return convs[:limit] if limit else convs


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    try:
        from ..data.chat import prompt_ids

        return list(prompt_ids(tokenizer, messages))
    except ImportError:
        pass
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def load_prompts(source: str, tokenizer, limit: int | None = None) -> list[list[int]]:
    return [encode_chat(tokenizer, m) for m in load_messages(source, limit)]


# -- methods ---------------------------------------------------------------------------------------


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def hf_generate(target, prompt_lookup: int | None = None, assistant=None
                ) -> Callable[[list[int], int], tuple[list[int], dict]]:
    """HF generate, greedy; with `prompt_lookup` or `assistant` (a Target sharing the
    tokenizer) its own speculative modes."""
    model = target.model
    eos = list(target.eos_token_ids)
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if eos else 0)

    @torch.no_grad()
    def run(prompt: list[int], max_new: int):
        ids = torch.tensor([prompt], device=target.device)
        kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=eos or None, pad_token_id=pad,
                  attention_mask=torch.ones_like(ids), temperature=None, top_p=None, top_k=None)
        if prompt_lookup:
            kw["prompt_lookup_num_tokens"] = prompt_lookup
        if assistant is not None:
            kw["assistant_model"] = assistant.model
        out = model.generate(ids, **kw)
        return out[0, len(prompt) :].tolist(), {}

    return run


def engine_run(engine) -> Callable[[list[int], int], tuple[list[int], dict]]:
    def run(prompt: list[int], max_new: int):
        res = engine.generate(prompt, SamplingParams(max_new_tokens=max_new))
        return res.token_ids, {"drafted": res.drafted, "accepted": res.accepted, "num_drafts": res.num_drafts,
                               "steps": res.num_steps}

    return run


def _time_method(row: Row, fn, prompts, max_new, dev, warmup_fn=None) -> Row:
    try:
        t0 = time.perf_counter()
        if warmup_fn is not None:
            warmup_fn()
        fn(prompts[0], min(16, max_new))  # untimed: first-call allocations, autotuning, caches
        _sync(dev)
        row.warmup_seconds = time.perf_counter() - t0
        drafted = accepted = drafts = 0
        for p in prompts:
            _sync(dev)
            t = time.perf_counter()
            toks, extra = fn(p, max_new)
            _sync(dev)
            row.seconds += time.perf_counter() - t
            row.new_tokens += len(toks)
            row.outputs.append(toks)
            drafted += extra.get("drafted", 0)
            accepted += extra.get("accepted", 0)
            drafts += extra.get("num_drafts", 0)
            row.steps += extra.get("steps", 0)
        row.prompts = len(prompts)
        if drafts:
            row.mean_acceptance_length = 1 + accepted / drafts
            row.acceptance_rate = accepted / drafted if drafted else 0.0
            row.drafted_per_step = drafted / drafts
    except Exception as e:  # one failing method must not lose the others' figures
        row.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    return row


def _agreement(row: Row, plain: Row) -> None:
    if row.error or plain.error or not plain.outputs:
        return
    same, fracs = 0, []
    for a, b in zip(row.outputs, plain.outputs):
        same += a == b
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        fracs.append(n / max(1, len(b)))
    row.identical_to_plain = same
    row.common_prefix_frac = sum(fracs) / len(fracs)


def _step_cost(row: Row, plain: Row) -> None:
    """What a speculative step costs in plain decoding steps, and c, the cost of one drafted token
    (drafting it and verifying it) in plain steps: the draft/target cost ratio that sets the best k
    (`specdec diagnose --cost-ratio`). From whole runs, prefill included in both, so a step's figure carries a
    share of the prompt's cost; steps that drafted nothing count as steps."""
    if row.error or plain.error or not (row.steps and plain.steps and row.drafted_per_step):
        return
    row.step_cost = (row.seconds / row.steps) / (plain.seconds / plain.steps)
    row.cost_per_draft = (row.step_cost - 1) / row.drafted_per_step


def run_bench(
    target,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 256,
    drafter=None,
    ngram: int = 3,
    ngram_k: int = 7,
    prompt_lookup_tokens: int = 10,
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7),
    tree=None,
    fast: bool | None = None,
    hf: bool = True,
    assistant=None,
    config: FastConfig = FastConfig(),
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Time every method over `prompts`; returns {"rows": [...], "fast": bool, ...}. The fast
    engines share one decoder, built with `config` (its max_len is set here)."""
    from ..engine.choice import engine_kind, make_engine
    from ..engine.static_decoder import FastDecoder
    from ..engine.static_layers import round_up

    dev = target.device
    say = progress or (lambda s: None)
    longest = max(len(p) for p in prompts)
    max_len = round_up(longest + max_new_tokens + 8, 256)
    rows: list[Row] = []
    config = replace(config, max_len=max_len)
    plain_engine = make_engine(target, fast=fast, config=config)
    kind = engine_kind(plain_engine)
    use_fast = kind == "fast"
    decoder: FastDecoder | None = plain_engine.fast if use_fast else None

    def engine(**kw):
        if use_fast:
            return make_engine(target, fast=True, decoder=decoder, config=config, **kw)
        return make_engine(target, fast=False, **kw)

    def warm(e):
        return (lambda: e.warmup()) if use_fast else None

    def add(row: Row) -> Row:
        # Each row's figure goes out as soon as it is measured: a run cut short keeps what it timed.
        rows.append(row)
        al = f", acceptance length {row.mean_acceptance_length:.2f}" if row.mean_acceptance_length else ""
        say(f"{row.method}: {row.error or f'{row.tok_s:.1f} tok/s'}{al}")
        return row

    if hf:
        say("hf-generate")
        add(_time_method(Row(method="hf-generate", engine="hf"), hf_generate(target), prompts, max_new_tokens, dev))
        say("hf-prompt-lookup")
        add(_time_method(Row(method="hf-prompt-lookup", engine="hf"),
                         hf_generate(target, prompt_lookup_tokens), prompts, max_new_tokens, dev))
    if assistant is not None:
        say("hf-assisted")
        add(_time_method(Row(method="hf-assisted", engine="hf"), hf_generate(target, assistant=assistant),
                         prompts, max_new_tokens, dev))
    say("specdec-plain")
    plain = add(_time_method(Row(method="specdec-plain", engine=kind), engine_run(plain_engine), prompts,
                             max_new_tokens, dev, warm(plain_engine)))
    say("specdec-ngram")
    e = engine(ngram=ngram, k=ngram_k)
    add(_time_method(Row(method="specdec-ngram", engine=kind), engine_run(e), prompts, max_new_tokens, dev, warm(e)))
    if drafter is not None:
        for k in ks:
            say(f"specdec-eagle3-k{k}")
            e = engine(drafter=drafter, k=k)
            add(_time_method(Row(method=f"specdec-eagle3-k{k}", engine=kind), engine_run(e), prompts,
                             max_new_tokens, dev, warm(e)))
        if tree is not None:
            say("specdec-eagle3-tree")
            e = engine(drafter=drafter, tree=tree)
            add(_time_method(Row(method="specdec-eagle3-tree", engine=kind), engine_run(e), prompts,
                             max_new_tokens, dev, warm(e)))
    for r in rows:
        if r is not plain:
            _agreement(r, plain)
            _step_cost(r, plain)
    base = {r.method: r.tok_s for r in rows if not r.error}
    out = []
    for r in rows:
        d = r.to_dict()
        d["vs_hf_generate"] = r.tok_s / base["hf-generate"] if base.get("hf-generate") and not r.error else None
        d["vs_specdec_plain"] = r.tok_s / base["specdec-plain"] if base.get("specdec-plain") and not r.error else None
        out.append(d)
    return {"rows": out, "engine": kind, "max_new_tokens": max_new_tokens, "prompts": len(prompts),
            "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts), "max_len": max_len}


def format_table(result: dict) -> str:
    head = (f"{'method':<22}{'engine':<10}{'tok/s':>9}{'ms/tok':>9}{'vs HF':>8}{'vs plain':>9}"
            f"{'accept len':>11}{'step cost':>10}{'c/draft':>8}{'same':>7}")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"{r['method']:<22}{r['engine']:<10}  error: {r['error']}")
            continue
        f = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        same = f"{r['identical_to_plain']}/{r['prompts']}" if r["identical_to_plain"] is not None else "ref"
        lines.append(
            f"{r['method']:<22}{r['engine']:<10}{r['tok_s']:>9.1f}{r['ms_per_token']:>9.2f}"
            f"{f(r['vs_hf_generate'], '.2f'):>8}{f(r['vs_specdec_plain'], '.2f'):>9}"
            f"{f(r['mean_acceptance_length'], '.2f'):>11}{f(r['step_cost'], '.2f'):>10}"
            f"{f(r['cost_per_draft'], '.2f'):>8}{same:>7}"
        )
    return "\n".join(lines)
