"""`regenerate --prompts self`: the user-turn header cut from the real SmolLM2 chat template, the
prompt filters and near-duplicate index, resume of the prompts file, and one CLI run end to end.

The SmolLM2 tests sample only a handful of short prompts (at most 32 tokens each) on the CPU."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.atomic import read_jsonl
from specdec.data.self_prompts import (Deduplicator, PromptFilter, SelfPromptConfig, UserTurnHeader, cut_prompt,
                                       filter_reason, jaccard, load_self_prompts, normalise, parse_topics,
                                       prompt_id, prompts_path, shingles, user_turn_header, write_self_prompts)
from specdec.errors import SpecdecError

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer

    from specdec.models.registry import fetch_model

    return AutoTokenizer.from_pretrained(fetch_model(SMOL))


@pytest.fixture(scope="module")
def smol(one_thread):
    from specdec.models.target import load_target

    return load_target(SMOL, device="cpu", dtype="fp32")


# -- the user-turn header --------------------------------------------------------------------

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(text=TEXT, system=st.none() | TEXT.filter(bool))
def test_header_plus_prompt_plus_end_renders_the_conversation(smol_tok, text, system):
    from specdec.data.chat import render_text

    h = user_turn_header(smol_tok, system)
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    assert h.prefix + text + h.suffix == render_text(smol_tok, msgs)


@pytest.mark.slow
def test_header_tokens_are_what_the_target_sees_and_it_stops_where_the_turn_ends(smol_tok):
    from specdec.data.chat import render, stop_strings

    plain, topical = user_turn_header(smol_tok), user_turn_header(smol_tok, "Questions about math.")
    assert "Questions about math." in topical.prefix and topical.prefix != plain.prefix
    for h, system in ((plain, None), (topical, "Questions about math.")):
        prefix_ids = smol_tok(h.prefix, add_special_tokens=False)["input_ids"]
        for prompt in ("What is a hash table?", "Write a haiku about rain.\nMake it sad."):
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            assert render(smol_tok, msgs).input_ids[: len(prefix_ids)] == prefix_ids
        # Generation stops at the eos token; that must be the marker that closes a user turn.
        assert h.end_marker in stop_strings(smol_tok) and h.end_marker == smol_tok.eos_token


@pytest.mark.slow
def test_header_without_a_template_and_with_one_that_drops_the_user(smol_tok):
    bare = copy.deepcopy(smol_tok)
    bare.chat_template = None  # the plain fallback format: "User: ...\n"
    h = user_turn_header(bare)
    assert h.prefix.endswith("User: ") and h.end_marker == "\n"
    deaf = copy.deepcopy(smol_tok)
    deaf.chat_template = "{% for m in messages %}<{{ m['role'] }}>{% endfor %}"
    with pytest.raises(SpecdecError, match="verbatim"):
        user_turn_header(deaf)


def test_cut_prompt_at_the_first_end_marker():
    h = UserTurnHeader("<u>", "<end>\n")
    assert cut_prompt("Why is the sky blue?<end>\n<u>more", h, []) == ("Why is the sky blue?", True)
    assert cut_prompt("a</s>b<end>", h, ["</s>"]) == ("a", True)
    assert cut_prompt("still going", h, ["</s>"]) == ("still going", False)
    assert cut_prompt("<end>\nWhy?", h, []) == ("", True)  # an empty turn is a finished, empty prompt
    assert cut_prompt("one line\nnext", UserTurnHeader("User: ", "\n"), []) == ("one line", True)


# -- filters -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text,reason", [
    ("", "empty"),
    ("   \n ", "empty"),
    ("Why?", "too_short"),
    ("word " * 500, "too_long"),
    ("What does \x07 mean in C?", "non_printable"),
    ("Why is this broken \ufffd here?", "non_printable"),
    ("1234 + 5678 = ??? ### ((()))", "non_letter"),
    ("Какая погода будет завтра в Москве?", "language"),
    ("明天北京的天气怎么样？请告诉我。", "language"),
    ("What is the capital of France?", None),
    ("Fix this: `x = [i**2 for i in range(10)]`", None),
])  # fmt: skip
def test_filter_reasons(text, reason):
    assert filter_reason(text) == reason


def test_filters_are_configurable():
    ru = "Какая погода будет завтра в Москве?"
    assert filter_reason(ru, PromptFilter(min_ascii_share=0)) is None  # the language check off
    assert filter_reason("Why?", PromptFilter(min_chars=2)) is None
    assert filter_reason("a" * 50, PromptFilter(max_chars=49)) == "too_long"


@given(st.text(max_size=60), st.sampled_from("\x00\x01\x1b\x7f\u200b\ue000"))
def test_any_control_or_private_character_is_non_printable(text, bad):
    padded = "What is this text " + text + bad + " about?"
    reason = filter_reason(padded, PromptFilter(max_chars=10_000))
    assert reason == "non_printable"


@given(st.text(max_size=80))
def test_normalise_folds_case_and_whitespace(text):
    n = normalise(text)
    assert normalise(n) == n
    assert normalise(text.upper().replace(" ", " \t\n ")) == normalise(text.upper())
    assert "  " not in n and n == n.strip()


def test_exact_and_near_duplicates():
    d = Deduplicator(near_duplicate=0.7)
    d.add("How do I sort a list of dictionaries by a key in Python?")
    assert d.reason("how do i sort a list   of dictionaries by a KEY in python?") == "duplicate"
    assert d.reason("How do I sort a list of dictionaries by a key in Python 3?") == "near_duplicate"
    assert d.reason("How do I sort a list of tuples by a key in Python?") is None  # 3 of 11 shingles differ
    assert d.reason("Write a poem about the sea at night.") is None
    assert Deduplicator(near_duplicate=1.01).reason("How do I sort a list of dictionaries by a key in Python 3?") \
        is None  # near-duplicate check off
    assert len(d) == 1


SENTENCE = st.lists(st.sampled_from("the a cat dog sat on mat ran far fast why how".split()), min_size=0, max_size=9)


@settings(max_examples=60, deadline=None)
@given(kept=st.lists(SENTENCE, max_size=8), candidate=SENTENCE, threshold=st.sampled_from([0.3, 0.5, 0.7, 1.0]))
def test_near_duplicate_index_agrees_with_brute_force(kept, candidate, threshold):
    """The inverted index finds a near-duplicate exactly when some kept prompt is that similar."""
    d = Deduplicator(near_duplicate=threshold)
    for words in kept:
        d.add(" ".join(words))
    text = " ".join(candidate)
    sh = shingles(text)
    exact = any(normalise(text) == normalise(" ".join(w)) for w in kept)
    near = bool(sh) and any(jaccard(sh, shingles(" ".join(w))) >= threshold for w in kept if shingles(" ".join(w)))
    expected = "duplicate" if exact else "near_duplicate" if near else None
    assert d.reason(text) == expected


def test_topics_from_a_list_or_a_file(tmp_path):
    assert parse_topics("code, math,,writing ") == ["code", "math", "writing"]
    assert parse_topics(None) == []
    f = tmp_path / "topics.txt"
    f.write_text("# one per line\ncooking\n\ntravel plans\n")
    assert parse_topics(str(f)) == ["cooking", "travel plans"]
    with pytest.raises(SpecdecError, match="no topics"):
        parse_topics(" , ")


def test_prompts_file_sits_next_to_the_output(tmp_path):
    assert prompts_path(tmp_path / "run" / "regen.jsonl") == tmp_path / "run" / "regen.self-prompts.jsonl"


# -- writing prompts ---------------------------------------------------------------------------


@pytest.mark.slow
def test_every_candidate_is_kept_or_counted_under_one_reason(smol, tmp_path, monkeypatch):
    """The pipeline's accounting on scripted continuations (the real tokenizer, no sampling)."""
    import specdec.data.regenerate as regen

    tok, eos = smol.tokenizer, smol.eos_token_ids[0]
    rounds = [
        ["What is the capital of France?", "what is the   capital of France?", "Hi", "Tell me about cats",
         "What is the capital of France today?", "Какая погода будет завтра в Москве?"],
        [None, "Write a limerick about a cat.", "Never judged: the limit is reached.", "Nor this."],
    ]  # None: a continuation cut off by the token limit
    calls = []

    def scripted(target, prompts, cfg, decoder=None):
        assert cfg.temperature == 1.0 and cfg.top_p == 0.99
        texts = rounds[len(calls)]
        calls.append(len(prompts))
        return [(tok.encode("A question cut off by"), "length") if t is None else (tok.encode(t) + [eos], "stop")
                for t in texts[: len(prompts)]]

    monkeypatch.setattr(regen, "generate_batch", scripted)
    out = tmp_path / "p.jsonl"
    s = write_self_prompts(smol, out, SelfPromptConfig(limit=3, batch_size=8), progress=False)
    assert [r["prompt"] for r in read_jsonl(out)] == [rounds[0][0], rounds[0][3], rounds[1][1]]
    assert s.filtered == {"duplicate": 1, "too_short": 1, "near_duplicate": 1, "language": 1, "unfinished": 1}
    assert s.kept == 3 and s.candidates == 8 == s.kept + sum(s.filtered.values())
    assert calls == [6, 4]  # twice the prompts still wanted, at least 4, at most the batch size
    assert all(r["id"] == prompt_id(r["prompt"]) for r in read_jsonl(out))


@pytest.mark.slow
def test_a_target_that_only_repeats_itself_stops_with_what_it_kept(smol, tmp_path, monkeypatch):
    import specdec.data.regenerate as regen

    eos = smol.eos_token_ids[0]
    same = smol.tokenizer.encode("What is the best way to learn to cook?") + [eos]
    monkeypatch.setattr(regen, "generate_batch", lambda target, prompts, *a, **k: [(same, "stop")] * len(prompts))
    out = tmp_path / "p.jsonl"
    # Round 1 keeps one of 4 candidates; then 3 rounds of 4 keep nothing.
    with pytest.raises(SpecdecError, match=r"rejected every candidate of 3 rounds.*duplicate 15.*rerun to continue"):
        write_self_prompts(smol, out, SelfPromptConfig(limit=2, max_idle_rounds=3), progress=False)
    assert [r["prompt"] for r in read_jsonl(out)] == ["What is the best way to learn to cook?"]


@pytest.mark.slow
def test_resume_keeps_earlier_prompts_and_only_writes_the_rest(smol, tmp_path, monkeypatch):
    import specdec.data.regenerate as regen

    out = tmp_path / "p.jsonl"
    cfg = SelfPromptConfig(limit=2, max_new_tokens=32, batch_size=4, seed=3)
    s1 = write_self_prompts(smol, out, cfg, progress=False)
    first = out.read_bytes()
    assert s1.kept == 2 and len(read_jsonl(out)) == 2
    assert s1.candidates == s1.kept + sum(s1.filtered.values())
    # Killed mid-append: the torn line is dropped, not counted.
    with open(out, "a") as f:
        f.write('{"id": "self/torn", "prompt": "Half a pro')
    real, calls = regen.generate_batch, []
    monkeypatch.setattr(regen, "generate_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    same = write_self_prompts(smol, out, cfg, progress=False)
    assert (same.resumed, same.kept, calls) == (2, 0, [])  # the limit is reached: nothing sampled
    assert out.read_bytes() == first
    cfg.limit = 4
    s2 = write_self_prompts(smol, out, cfg, progress=False)
    assert s2.resumed == 2 and s2.kept == 2 and calls
    assert out.read_bytes().startswith(first)  # earlier prompts untouched, not regenerated
    prompts = [r["prompt"] for r in read_jsonl(out)]
    assert len(prompts) == 4 and len({normalise(p) for p in prompts}) == 4
    assert all(filter_reason(p) is None for p in prompts)
    assert [c.messages for c in load_self_prompts(out, 3)] == [[{"role": "user", "content": p}] for p in prompts[:3]]


@pytest.mark.slow
def test_topics_round_robin_into_the_header(smol, tmp_path, monkeypatch):
    import specdec.data.regenerate as regen

    tok = smol.tokenizer
    seen = []

    def record(target, prompts, cfg, decoder=None):
        seen.extend(tok.decode(p) for p in prompts)
        return [(tok.encode(f"Tell me one thing number {i} about this, please.") + [smol.eos_token_ids[0]], "stop")
                for i in range(len(prompts))]

    monkeypatch.setattr(regen, "generate_batch", record)
    out = tmp_path / "p.jsonl"
    cfg = SelfPromptConfig(limit=4, topics=["cooking", "chess"], filter=PromptFilter(near_duplicate=2))
    write_self_prompts(smol, out, cfg, progress=False)
    assert ["cooking" in s for s in seen] == [True, False] * (len(seen) // 2)
    assert ["chess" in s for s in seen] == [False, True] * (len(seen) // 2)
    assert [r["topic"] for r in read_jsonl(out)] == ["cooking", "chess", "cooking", "chess"]


# -- the command -------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_writes_prompts_then_answers_them(tmp_path, one_thread):
    from specdec.cli import main

    out = tmp_path / "regen.jsonl"
    args = ["regenerate", "--target", SMOL, "--prompts", "self", "--limit", "2", "--self-max-tokens", "32",
            "--max-new-tokens", "8", "--batch-size", "4", "--self-topics", "cooking,travel", "--no-progress",
            "-o", str(out)]
    assert main(args) == 0
    prompts = read_jsonl(prompts_path(out))
    recs = read_jsonl(out)
    assert len(prompts) == 2 and {r["id"] for r in recs} == {p["id"] for p in prompts}
    by_id = {p["id"]: p for p in prompts}
    for r in recs:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert r["messages"][0]["content"] == by_id[r["id"]]["prompt"]
        assert r["target"] == SMOL and r["finish_reason"] in ("stop", "length")
        assert 1 <= r["new_tokens"] <= 8
    json.dumps(recs)
    # The output is a prompt source for capture like any other; the prompts file is one for regenerate.
    from specdec.data.datasets import load_conversations

    assert [c.id for c in load_conversations(str(prompts_path(out)))] == [p["id"] for p in prompts]


@pytest.mark.parametrize("extra,needle", [
    (["--endpoint", "http://127.0.0.1:9"], "needs --target"),
    (["--target", "tiny-llama"], "needs --limit"),
])  # fmt: skip
def test_cli_says_what_self_prompts_need(tmp_path, capsys, extra, needle):
    from specdec.cli import main

    assert main(["regenerate", "--prompts", "self", *extra, "-o", str(tmp_path / "r.jsonl")]) != 0
    assert needle in capsys.readouterr().err


def test_self_topics_without_self_prompts_is_an_error(tmp_path, capsys):
    from specdec.cli import main

    assert main(["regenerate", "--target", "tiny-llama", "--prompts", "mt-bench", "--self-topics", "x",
                 "-o", str(tmp_path / "r.jsonl")]) != 0
    assert "--self-topics applies only" in capsys.readouterr().err


@pytest.mark.slow
def test_the_quickstart_adds_own_prompts_over_the_broad_topics(smol, tmp_path):
    """`quickstart --self-prompts N`: N prompts SmolLM2 samples on the batch decoder, spread over
    the broad topics, kept next to regen.jsonl, returned as one-turn conversations to answer; a
    rerun reads them back instead of sampling again."""
    from specdec.commands.quickstart import own_prompts
    from specdec.data.self_prompts import BROAD_TOPICS, parse_topics

    assert parse_topics("broad") == list(BROAD_TOPICS)
    lines = []
    convs = own_prompts(smol, tmp_path / "regen.jsonl", 3, 4, log=lines.append)
    kept = read_jsonl(tmp_path / "regen.self-prompts.jsonl")
    assert [c.messages[0]["content"] for c in convs] == [r["prompt"] for r in kept] and len(kept) == 3
    assert all(r["topic"] in BROAD_TOPICS for r in kept) and all(filter_reason(r["prompt"]) is None for r in kept)
    assert "self-written prompts: 3 (3 new" in lines[0]
    assert [c.id for c in own_prompts(smol, tmp_path / "regen.jsonl", 3, 4, log=lines.append)] == [c.id for c in convs]
    assert lines[1] == f"prompts in {tmp_path / 'regen.self-prompts.jsonl'}"
    assert "(0 new, 3 from an earlier run)" in lines[2]
