"""Prompts written by the target itself (the Magpie method, Xu et al. 2024).

An instruction-tuned model that is shown only the text that opens a user turn in its chat template
writes a plausible user message: the prompts come from the target's own distribution, need no
public data set, and are as many as one asks for. `specdec regenerate --prompts self` then answers
them like any other prompt source.

How a prompt is written:
  1. The user-turn header: the conversation [system?, user(SENTINEL)] is rendered with the chat
     template and cut at the sentinel. What comes before it (with any system prompt the template
     inserts by default) is the header; what comes after it closes the turn.
  2. The target samples a continuation of the header (temperature 1.0, top-p 0.99 by default)
     with regenerate's own batched generation, stopping at its end-of-turn token; the text up to
     the end-of-turn marker is the prompt. A continuation that hits the token limit is cut
     mid-sentence and dropped.
  3. Filters, each counted: empty, too short or too long (characters), non-printable characters,
     mostly non-letters, not mostly ASCII letters (a cheap language check; off with
     `min_ascii_share=0`), template text leaking into the prompt, exact duplicates (case and
     whitespace folded) and near-duplicates (Jaccard similarity of word 3-gram sets against every
     kept prompt, through an inverted index: exact and deterministic, no MinHash).

Topics: with `topics`, each candidate's header carries a system message naming one topic, the
topics taken round-robin, so the prompts spread over them. Without, it is plain Magpie.

Resume: kept prompts are appended (fsynced, one JSON line each) to a prompts file, by default next
to the regenerate output (`regen.jsonl` -> `regen.self-prompts.jsonl`). A rerun reads it back
(dropping a line torn by a kill), counts it toward the limit and deduplicates against it. The
sampling seed of a round is derived from (seed, prompts kept, rounds since the last keep), so a
rerun samples new candidates rather than the ones an earlier run already judged.
Each line is a valid record of a local prompt file: {"id", "prompt", "topic"?}.

Examples:
    specdec regenerate --target smollm2-135m-instruct --prompts self --limit 200 -o runs/smol/regen.jsonl
    specdec regenerate --target smollm2-135m-instruct --prompts self --self-topics "code,math,writing" \\
        --limit 1000 -o runs/smol/regen.jsonl
"""

from __future__ import annotations

import hashlib
import re
import time
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ..atomic import append_jsonl, repair_jsonl
from ..errors import SpecdecError
from .datasets import Conversation

SOURCE_NAME = "self"  # the `--prompts` value that selects this source
SENTINEL = "\x00SPECDEC_USER_TURN\x00"  # no real message contains a NUL, so one match is the user slot
# Topics for prompts meant to cover what chat users ask: the quickstart's, and `--self-topics broad`.
BROAD_TOPICS = ("programming", "mathematics", "creative writing", "role-play", "logical reasoning", "science",
                "history and culture", "business and economics", "health", "travel",
                "summarizing or extracting facts from a text", "everyday advice")
DEFAULT_TOPIC_SYSTEM = ("You are a helpful AI assistant. The user will ask you a question or give you a task "
                        "about {topic}.")

# Control, format, surrogate, private-use and unassigned characters; U+FFFD marks bytes that were
# not valid UTF-8 (a tokenizer emitting half a character).
_NON_PRINTABLE = {"Cc", "Cf", "Cs", "Co", "Cn"}
_WORD = re.compile(r"\w+")


# -- filters (pure functions) ----------------------------------------------------------------


@dataclass(kw_only=True)
class PromptFilter:
    min_chars: int = 10
    max_chars: int = 2000
    min_letter_share: float = 0.4  # letters among non-space characters; low enough for prompts quoting code
    min_ascii_share: float = 0.9  # ASCII letters among letters; 0 turns the language check off
    near_duplicate: float = 0.7  # Jaccard of word 3-gram sets; > 1 turns the check off
    shingle: int = 3


def normalise(text: str) -> str:
    """What two prompts share when they are the same prompt: case folded, whitespace collapsed."""
    return " ".join(text.casefold().split())


def filter_reason(text: str, f: PromptFilter | None = None) -> str | None:
    """Why `text` is not a usable prompt on its own (None: it is). Duplicates are checked apart, by
    `Deduplicator`, since they depend on what was kept before."""
    f = f or PromptFilter()
    text = text.strip()
    if not text:
        return "empty"
    if len(text) < f.min_chars:
        return "too_short"
    if len(text) > f.max_chars:
        return "too_long"
    if any(c == "\ufffd" or (unicodedata.category(c) in _NON_PRINTABLE and c not in "\n\t\r") for c in text):
        return "non_printable"
    visible = [c for c in text if not c.isspace()]
    letters = [c for c in visible if c.isalpha()]
    if len(letters) < f.min_letter_share * len(visible):
        return "non_letter"
    if f.min_ascii_share > 0 and sum(c.isascii() for c in letters) < f.min_ascii_share * len(letters):
        return "language"
    return None


def shingles(text: str, n: int = 3) -> frozenset[tuple[str, ...]]:
    """The set of word n-grams of `text` (case folded); a text shorter than n words is one shingle."""
    words = _WORD.findall(text.casefold())
    if len(words) < n:
        return frozenset([tuple(words)]) if words else frozenset()
    return frozenset(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


class Deduplicator:
    """Exact and near-duplicate checks against every prompt added so far.

    Near-duplicates use an inverted index from shingle to prompts, so a candidate is compared only
    with prompts it shares a shingle with; the Jaccard value is exact, not a MinHash estimate."""

    def __init__(self, near_duplicate: float = 0.7, shingle: int = 3):
        self.threshold = near_duplicate
        self.n = shingle
        self._exact: set[str] = set()
        self._index: dict[tuple[str, ...], list[int]] = {}
        self._sizes: list[int] = []

    def __len__(self) -> int:
        return len(self._exact)

    def reason(self, text: str) -> str | None:
        """"duplicate", "near_duplicate" or None."""
        if normalise(text) in self._exact:
            return "duplicate"
        if self.threshold <= 1 and self._nearest(shingles(text, self.n)) >= self.threshold:
            return "near_duplicate"
        return None

    def add(self, text: str) -> None:
        self._exact.add(normalise(text))
        sh = shingles(text, self.n)
        k = len(self._sizes)
        self._sizes.append(len(sh))
        for s in sh:
            self._index.setdefault(s, []).append(k)

    def _nearest(self, sh: frozenset) -> float:
        shared = Counter(k for s in sh for k in self._index.get(s, ()))
        return max((c / (len(sh) + self._sizes[k] - c) for k, c in shared.items()), default=0.0)


# -- the user-turn header ----------------------------------------------------------------------


@dataclass(frozen=True)
class UserTurnHeader:
    prefix: str  # everything the template writes before the user's text
    suffix: str  # what closes the user turn

    @property
    def end_marker(self) -> str:
        """The text whose appearance ends the prompt: the suffix without its trailing whitespace
        (`<|im_end|>` of `<|im_end|>\\n`), or the bare suffix where that is all whitespace (the
        plain fallback format ends a user turn with a newline)."""
        return self.suffix.strip() or self.suffix


def user_turn_header(tokenizer, system: str | None = None) -> UserTurnHeader:
    """Cut the chat template's rendering of [system?, user(SENTINEL)] at the sentinel."""
    from .chat import render_text

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = render_text(tokenizer, messages)
    if text.count(SENTINEL) != 1:
        raise SpecdecError(
            f"the chat template wrote the user message {text.count(SENTINEL)} times instead of once; "
            f"--prompts self needs a template that reproduces the user's text verbatim")
    prefix, suffix = text.split(SENTINEL)
    return UserTurnHeader(prefix, suffix)


def cut_prompt(text: str, header: UserTurnHeader, stop_strings: Iterable[str]) -> tuple[str, bool]:
    """The prompt in a sampled continuation: the text before the first end-of-turn marker, and
    whether a marker was found (False: the text ran on, unless the generation itself stopped)."""
    cut = -1
    for s in {header.end_marker, *stop_strings}:
        k = text.find(s) if s else -1
        if k >= 0 and (cut < 0 or k < cut):
            cut = k
    return (text[:cut], True) if cut >= 0 else (text, False)


# -- topics ------------------------------------------------------------------------------------


def parse_topics(value: str | None) -> list[str]:
    """A file with one topic per line, a comma-separated list, or "broad" (BROAD_TOPICS); empty
    entries are dropped."""
    if not value:
        return []
    if value == "broad" and not Path(value).is_file():
        return list(BROAD_TOPICS)
    path = Path(value).expanduser()
    if path.is_file():
        items = path.read_text(encoding="utf-8").splitlines()
    else:
        items = value.split(",")
    topics = [t.strip() for t in items if t.strip() and not t.strip().startswith("#")]
    if not topics:
        raise SpecdecError(f"no topics in {value!r}; expected a comma-separated list or a file with one per line")
    return topics


# -- generation --------------------------------------------------------------------------------


@dataclass(kw_only=True)
class SelfPromptConfig:
    limit: int
    seed: int = 0
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 0.99
    batch_size: int = 32  # candidates sampled at once
    topics: Sequence[str] = ()
    topic_system: str = DEFAULT_TOPIC_SYSTEM  # "{topic}" is replaced by the topic
    filter: PromptFilter = field(default_factory=PromptFilter)
    max_idle_rounds: int = 10  # rounds in a row that keep nothing before giving up


@dataclass
class SelfPromptStats:
    resumed: int = 0  # kept by an earlier run
    kept: int = 0  # kept by this run
    candidates: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    filtered: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.resumed + self.kept

    def line(self) -> str:
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(self.filtered.items(), key=lambda kv: (-kv[1], kv[0])))
        return (f"self-written prompts: {self.total:,} ({self.kept:,} new, {self.resumed:,} from an earlier run); "
                f"{self.candidates:,} candidates, {sum(self.filtered.values()):,} filtered"
                + (f": {reasons}" if reasons else "") + f"; {self.seconds:.1f} s")


def prompts_path(out_path: str | Path) -> Path:
    """Where `regenerate -o OUT.jsonl --prompts self` keeps its prompts: OUT.self-prompts.jsonl."""
    out = Path(out_path)
    return out.with_name(out.stem + ".self-prompts.jsonl")


def prompt_id(text: str) -> str:
    """By content: ids stay unique (prompts are deduplicated) and mean the same prompt even if the
    prompts file is deleted while the regenerate output is kept."""
    return "self/" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _round_seed(seed: int, kept: int, attempt: int) -> int:
    digest = hashlib.sha256(f"{seed}/{kept}/{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _headers(tokenizer, cfg: SelfPromptConfig) -> list[tuple[str | None, UserTurnHeader]]:
    if not cfg.topics:
        return [(None, user_turn_header(tokenizer))]
    return [(t, user_turn_header(tokenizer, cfg.topic_system.replace("{topic}", t))) for t in cfg.topics]


def write_self_prompts(target, path: str | Path, cfg: SelfPromptConfig, *, progress: bool = True) -> SelfPromptStats:
    """Sample prompts from `target` until `path` holds `cfg.limit` of them; resumes from `path`."""
    import torch

    from ..progress import progress_bar
    from .chat import stop_strings
    from .regenerate import RegenConfig, batch_decoder, generate_batch

    tok = target.tokenizer
    if tok is None:
        raise SpecdecError("the target has no tokenizer; --prompts self renders its chat template")
    if cfg.limit < 0 or cfg.batch_size < 1:
        raise SpecdecError(f"expected limit >= 0 and batch size >= 1, found {cfg.limit} and {cfg.batch_size}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dedup = Deduplicator(cfg.filter.near_duplicate, cfg.filter.shingle)
    for r in repair_jsonl(path):
        dedup.add(r["prompt"])
    stats = SelfPromptStats(resumed=len(dedup))
    headers = _headers(tok, cfg)
    header_ids = [tok(h.prefix, add_special_tokens=False)["input_ids"] for _, h in headers]
    stops = stop_strings(tok)
    eos = set(target.eos_token_ids)
    gen = RegenConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p)
    decoder = batch_decoder(target) if cfg.limit > stats.total else None
    t0 = time.perf_counter()
    idle = 0
    with open(path, "a", encoding="utf-8") as f, progress_bar(enabled=progress) as prog:
        task = prog.add_task("writing prompts", total=cfg.limit, completed=min(stats.total, cfg.limit), rate="")
        while stats.total < cfg.limit:
            if idle >= cfg.max_idle_rounds:
                raise SpecdecError(
                    f"the filters rejected every candidate of {idle} rounds in a row ({stats.line()}); "
                    f"{stats.total:,} prompts are kept in {path}; loosen the --self-* filters or raise "
                    f"--self-max-tokens, then rerun to continue")
            need = cfg.limit - stats.total
            n = min(cfg.batch_size, max(4, 2 * need))  # oversampled: the filters drop a share
            slots = [(stats.total + i) % len(headers) for i in range(n)]  # topics round-robin
            torch.manual_seed(_round_seed(cfg.seed, stats.total, idle))
            outs = generate_batch(target, [header_ids[s] for s in slots], gen, decoder)
            before = stats.kept
            for s, (new, reason) in zip(slots, outs):
                if stats.total >= cfg.limit:
                    break  # the rest of the round is neither judged nor counted
                stats.candidates += 1
                stats.new_tokens += len(new)
                body = new[:-1] if new and new[-1] in eos else new
                text, marked = cut_prompt(tok.decode(body, skip_special_tokens=False), headers[s][1], stops)
                why = _judge(text.strip(), marked or reason == "stop", tok, cfg.filter, dedup)
                if why is not None:
                    stats.filtered[why] = stats.filtered.get(why, 0) + 1
                    continue
                rec = {"id": prompt_id(text.strip()), "prompt": text.strip()}
                if headers[s][0] is not None:
                    rec["topic"] = headers[s][0]
                append_jsonl(f, rec)
                dedup.add(rec["prompt"])
                stats.kept += 1
            idle = 0 if stats.kept > before else idle + 1
            el = time.perf_counter() - t0
            prog.update(task, completed=min(stats.total, cfg.limit),
                        rate=f"{stats.candidates:,} candidates, {stats.kept / max(stats.candidates, 1):.0%} kept, "
                             f"{stats.new_tokens / el if el > 0 else 0:,.0f} tok/s")
    stats.seconds = time.perf_counter() - t0
    return stats


def _judge(text: str, finished: bool, tokenizer, f: PromptFilter, dedup: Deduplicator) -> str | None:
    if text and not finished:
        return "unfinished"  # cut off by the token limit: a prompt that stops mid-sentence
    why = filter_reason(text, f)
    if why is None and any(s and s in text for s in tokenizer.all_special_tokens):
        why = "template_text"  # the model wrote a turn marker of its own (a second turn, say)
    return why or dedup.reason(text)


def self_prompt_conversations(target, out_path: str | Path, cfg: SelfPromptConfig, *, progress: bool = True,
                              log=print) -> list[Conversation]:
    """`--prompts self` for a regenerate output `out_path`: its prompts file filled up to
    `cfg.limit` (write_self_prompts, resumed), what was done logged, the prompts as conversations."""
    path = prompts_path(out_path)
    log(write_self_prompts(target, path, cfg, progress=progress).line())
    log(f"prompts in {path}")
    return load_self_prompts(path, cfg.limit)


def load_self_prompts(path: str | Path, limit: int | None = None) -> list[Conversation]:
    """The first `limit` prompts of a prompts file as one-turn conversations, in file order."""
    out = []
    for r in repair_jsonl(path)[:limit]:
        meta = {"topic": r["topic"]} if r.get("topic") else {}
        out.append(Conversation(id=r["id"], messages=[{"role": "user", "content": r["prompt"]}], meta=meta))
    return out
