"""Acceptance measured by running the engine: the numbers `specdec eval` and `quickstart` print.

Every prompt's first user turn (after an optional system message) goes through
`engine.generate`; the per-step counters of the results are summed, so the aggregate equals what
vLLM's Prometheus counters would give over the same requests:

    per_position_acceptance[i] = sum(accepted at position i) / sum(num_drafts)
                                 (P(at least i+1 drafts accepted), vLLM's accepted_tokens_per_pos)
    mean_acceptance_length     = 1 + accepted / num_drafts   (tokens per target pass that drafted)
    acceptance_rate            = accepted / drafted
    tokens_per_s               = new tokens / generation seconds, summed over prompts

When the prompts carry categories (MT-Bench's, HumanEval's "code", a local record's "category"),
`per_category` holds the same summary per category, sorted by name, with `num_prompts`: a mean
hides a drafter that is strong on writing and weak on math. Counters add up, so the overall
figures are the per-category ones weighted by `num_drafts`.

With `compare_plain`, each prompt also runs without drafting (same engine class, same target),
right after its speculative run, and `speedup` = tokens_per_s / plain_tokens_per_s. Under greedy
decoding speculative output must equal plain output; the mismatches are counted so a lossless
violation is visible.

Example:
    from specdec.evaluate import evaluate
    result = evaluate(engine, target.tokenizer, load_conversations("mt-bench", limit=5),
                      max_new_tokens=128, compare_plain=True)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from .errors import SpecdecError


def first_turn(messages: Sequence[dict]) -> list[dict]:
    """The messages up to and including the first user message (system prompt kept)."""
    out = []
    for m in messages:
        out.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            return out
    raise SpecdecError("a conversation has no user message: expected at least one user turn")


def _plain_like(engine):
    """A drafting-free engine of the same kind on the same target (a FastEngine shares its decoder)."""
    try:
        from .engine.fast import FastEngine
    except Exception:  # the fast path's imports are optional for the reference engine
        FastEngine = None
    if FastEngine is not None and isinstance(engine, FastEngine):
        return FastEngine(engine.target, k=engine.k, decoder=engine.fast,
                          config=replace(engine.config, max_len=engine.max_len, require_cuda=False))
    from .engine.engine import SpeculativeEngine

    return SpeculativeEngine(engine.target, k=engine.k)


class _Progress:
    """A rich progress bar on stderr (prompts done, tok/s, acceptance so far, ETA), or nothing."""

    def __init__(self, enabled: bool, total: int):
        self.bar = None
        if not enabled:
            return
        from .progress import progress_bar

        self.bar = progress_bar()
        self.total = total

    def __enter__(self):
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def task(self, description: str):
        return self.bar.add_task(description, total=self.total, rate="") if self.bar is not None else None

    def advance(self, task, rate: str):
        if self.bar is not None:
            self.bar.update(task, advance=1, rate=rate)


def _run(runs, prompts: list[list[int]], params, progress: _Progress) -> list[list]:
    """Each prompt through every (engine, label, counts acceptance) of `runs` in turn, so a drift of
    the machine over minutes (a shared 2-core CPU's plain decoding measured 11.8-24.2 tok/s within a
    day) moves every engine alike and their ratio keeps; one result list per run."""
    tasks = [progress.task(label) for _, label, _ in runs]
    results = [[] for _ in runs]
    for ids in prompts:
        for (engine, _, acceptance), task, done in zip(runs, tasks, results):
            done.append(engine.generate(ids, params))
            progress.advance(task, _rate(done, acceptance))
    return results


def _rate(results, acceptance: bool) -> str:
    """The progress bar's figures so far: tok/s, and the acceptance length where it counts."""
    tokens = sum(r.new_tokens for r in results)
    seconds = sum(r.seconds for r in results)
    drafts = sum(r.num_drafts for r in results)
    rate = f"{tokens / seconds:.1f} tok/s" if seconds > 0 else ""
    if acceptance and drafts:
        rate += f", AL {1 + sum(r.accepted for r in results) / drafts:.2f}"
    return rate


def _warm(engine, ids: list[int], params) -> None:
    """One short untimed generation: kernels, allocator and (FastEngine) compilation warm up."""
    from .engine.api import SamplingParams

    engine.generate(ids, SamplingParams(max_new_tokens=min(8, params.max_new_tokens), temperature=params.temperature,
                                        top_p=params.top_p, seed=params.seed))


def summarize(results, k: int | None = None) -> dict:
    """Aggregate `GenerationResult`s into the acceptance summary (keys as `specdec report` reads)."""
    num_drafts = sum(r.num_drafts for r in results)
    drafted = sum(r.drafted for r in results)
    accepted = sum(r.accepted for r in results)
    depth = max([len(r.accepted_per_position) for r in results] + [k or 0])
    per_pos = [0] * depth
    for r in results:
        for i, n in enumerate(r.accepted_per_position):
            per_pos[i] += n
    tokens = sum(r.new_tokens for r in results)
    seconds = sum(r.seconds for r in results)
    return {
        "per_position_acceptance": [n / num_drafts for n in per_pos] if num_drafts else [0.0] * depth,
        "mean_acceptance_length": 1.0 + accepted / num_drafts if num_drafts else 1.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "num_drafts": num_drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "accepted_per_position": per_pos,
        "k": k,
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "target_passes": sum(r.num_steps for r in results),
    }


def category_of(conversation) -> str | None:
    """A conversation's category, or None (plain message lists and uncategorized records)."""
    meta = getattr(conversation, "meta", None)
    return meta.get("category") if isinstance(meta, dict) else None


UNCATEGORIZED = "(none)"


def by_category(conversations, results, k: int | None = None) -> list[dict]:
    """`summarize` per category of `conversations` (paired with `results`), sorted by category;
    empty when none carries a category. Prompts without one, next to some that have one, form
    their own row, so the rows always cover every prompt."""
    groups: dict[str, list] = {}
    for c, r in zip(conversations, results):
        groups.setdefault(category_of(c) or UNCATEGORIZED, []).append(r)
    if list(groups) == [UNCATEGORIZED]:
        return []
    return [{"category": name, "num_prompts": len(rs), **summarize(rs, k)} for name, rs in sorted(groups.items())]


def evaluate(engine, tokenizer, conversations, *, max_new_tokens: int, compare_plain: bool = False,
             progress: bool = True, params=None, warmup: bool = True) -> dict:
    """Run `engine` over the first user turn of each conversation; returns the summary dict.

    `params` (SamplingParams) overrides greedy decoding; `max_new_tokens` always applies.
    """
    from .data.chat import prompt_ids
    from .engine.api import SamplingParams

    if max_new_tokens < 1:
        raise SpecdecError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    conversations = list(conversations)
    if not conversations:
        raise SpecdecError("no prompts to evaluate: the prompt source is empty (check --prompts / --limit)")
    if params is None:
        params = SamplingParams(max_new_tokens=max_new_tokens)
    else:
        from dataclasses import replace

        params = replace(params, max_new_tokens=max_new_tokens)
    prompts = [prompt_ids(tokenizer, first_turn(c.messages if hasattr(c, "messages") else c))
               for c in conversations]
    # Prompts that cannot fit the context with max_new_tokens are skipped and counted, not fatal.
    max_len = getattr(engine, "max_len", None) or 1 << 30
    fits = [i for i, ids in enumerate(prompts) if len(ids) + max_new_tokens <= max_len]
    skipped = len(prompts) - len(fits)
    if not fits:
        raise SpecdecError(
            f"every prompt is longer than the engine's context of {max_len} tokens minus "
            f"max_new_tokens {max_new_tokens} (shortest: {min(map(len, prompts))} tokens); lower "
            f"--max-new-tokens or use shorter prompts"
        )
    conversations = [conversations[i] for i in fits]
    prompts = [prompts[i] for i in fits]
    k = getattr(engine, "k", None)
    tree = getattr(engine, "tree", None)
    if tree is not None:
        k = tree.depth
    plain = _plain_like(engine) if compare_plain else None
    with _Progress(progress, len(prompts)) as bar:
        if warmup:
            _warm(engine, prompts[0], params)
            if plain is not None:
                _warm(plain, prompts[0], params)
        runs = [(engine, f"{getattr(engine, 'mode', 'engine')}", True)]
        if plain is not None:
            runs.append((plain, "plain", False))
        results, *rest = _run(runs, prompts, params, bar)
        plain_results = rest[0] if rest else None
    out = {
        "mode": getattr(engine, "mode", None),
        "num_prompts": len(prompts),
        "skipped_prompts": skipped,
        "max_new_tokens": max_new_tokens,
        "temperature": params.temperature,
        **summarize(results, k),
        "per_prompt": [
            {"id": getattr(c, "id", str(i)), "prompt_tokens": r.prompt_tokens, "new_tokens": r.new_tokens,
             "seconds": r.seconds, "num_drafts": r.num_drafts, "drafted": r.drafted, "accepted": r.accepted,
             "finish_reason": r.finish_reason}
            for i, (c, r) in enumerate(zip(conversations, results))
        ],
    }
    per_category = by_category(conversations, results, k)
    if per_category:
        out["per_category"] = per_category
    if tree is not None:
        out["tree"] = {"depth": tree.depth, "top_k": tree.top_k, "total_tokens": tree.total_tokens}
    if plain_results is not None:
        p = summarize(plain_results)
        out["plain_tokens_per_s"] = p["tokens_per_s"]
        out["plain_seconds"] = p["seconds"]
        out["plain_new_tokens"] = p["new_tokens"]
        for row, r in zip(out["per_prompt"], plain_results):  # per prompt too, for reports
            row["plain_new_tokens"], row["plain_seconds"] = r.new_tokens, r.seconds
        out["speedup"] = out["tokens_per_s"] / p["tokens_per_s"] if p["tokens_per_s"] > 0 else 0.0
        if params.temperature <= 0:
            out["plain_output_mismatches"] = sum(a.token_ids != b.token_ids for a, b in zip(results, plain_results))
    return out
