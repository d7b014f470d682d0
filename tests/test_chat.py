"""chat.render: one rendering for regenerate/capture/train/eval, and a loss mask that is 1 exactly on
assistant content plus the end-of-turn token closing it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.data.chat import FALLBACK_TEMPLATE, Rendered, prompt_ids, render, render_text
from specdec.models.tiny import byte_tokenizer

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi é"},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "more"},
    {"role": "assistant", "content": "Sure: 1, 2, 3."},
]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def masked_text(tok, r: Rendered) -> str:
    return tok.decode([i for i, m in zip(r.input_ids, r.loss_mask) if m])


def masked_runs(r: Rendered) -> list[tuple[int, int]]:
    runs, start = [], None
    for t, m in enumerate(r.loss_mask + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


def test_mask_covers_assistant_content_and_end_of_turn_only(tok):
    r = render(tok, CONV)
    assert len(r.input_ids) == len(r.loss_mask)
    assert r.input_ids == tok(render_text(tok, CONV), add_special_tokens=False)["input_ids"]
    runs = masked_runs(r)
    assert [tok.decode(r.input_ids[a:b]) for a, b in runs] == [
        "Hello there!<|im_end|>",
        "Sure: 1, 2, 3.<|im_end|>",
    ]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for a, b in runs:
        assert r.input_ids[b - 1] == end  # the drafter learns to stop
        assert tok.decode(r.input_ids[a - 10 : a]).endswith("assistant\n")
    assert r.num_loss_tokens == sum(b - a for a, b in runs)


def test_prompt_ids_is_the_generation_prefix(tok):
    p = prompt_ids(tok, CONV)
    assert tok.decode(p).endswith("<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    full = render(tok, CONV).input_ids
    assert full[: len(p)] == p
    assert prompt_ids(tok, CONV[:4]) == p  # no trailing assistant: same prompt
    r = render(tok, CONV[:4], add_generation_prompt=True)
    assert r.input_ids == p and r.num_loss_tokens == 1 + len("Hello there!")


def test_fallback_format_without_chat_template():
    tok = byte_tokenizer()
    tok.chat_template = None
    msgs = CONV[1:]
    assert render_text(tok, msgs) == (
        "User: hi é\nAssistant: Hello there!<|im_end|>\nUser: more\nAssistant: Sure: 1, 2, 3.<|im_end|>\n"
    )
    r = render(tok, msgs)
    assert masked_text(tok, r) == " Hello there!<|im_end|> Sure: 1, 2, 3.<|im_end|>"
    assert tok.decode(prompt_ids(tok, msgs)).endswith("User: more\nAssistant:")
    assert "eos_token" in FALLBACK_TEMPLATE


def test_template_that_rewrites_history_still_masks_right():
    # The header depends on the number of messages, so no render of a prefix is a prefix.
    tok = byte_tokenizer()
    tok.chat_template = (
        "[{{ messages|length }} msgs]\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    r = render(tok, CONV)
    assert [tok.decode(r.input_ids[a:b]) for a, b in masked_runs(r)] == [
        "Hello there!<|im_end|>",
        "Sure: 1, 2, 3.<|im_end|>",
    ]


def test_template_without_end_marker_masks_content_only():
    tok = byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tok.eos_token = None
    r = render(tok, CONV[1:3])
    assert masked_text(tok, r) == " Hello there!"


def test_empty_and_generation_only(tok):
    assert render(tok, []) == Rendered([], [])
    r = render(tok, [{"role": "user", "content": "x"}], add_generation_prompt=True)
    assert r.num_loss_tokens == 0 and tok.decode(r.input_ids).endswith("assistant\n")


TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<>"), min_size=1, max_size=30
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=4), system=st.none() | TEXT)
def test_mask_property_random_conversations(tok, turns, system):
    msgs = [{"role": "system", "content": system}] if system else []
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    r = render(tok, msgs)
    assert masked_text(tok, r) == "".join(a + "<|im_end|>" for _, a in turns)
    assert len(masked_runs(r)) == len(turns)


@pytest.mark.slow
def test_smollm2_tokenizer_mask():
    from transformers import AutoTokenizer

    from specdec.models.registry import fetch_model

    tok = AutoTokenizer.from_pretrained(fetch_model("smollm2-135m-instruct"))
    r = render(tok, CONV)
    runs = masked_runs(r)
    assert [tok.decode(r.input_ids[a:b]) for a, b in runs] == [
        "Hello there!<|im_end|>",
        "Sure: 1, 2, 3.<|im_end|>",
    ]
    p = prompt_ids(tok, CONV)
    assert r.input_ids[: len(p)] == p
    # Without a system message SmolLM2's template injects its own; it must stay unmasked.
    r2 = render(tok, CONV[1:])
    assert "SmolLM" in tok.decode(r2.input_ids)
    assert tok.decode([i for i, m in zip(r2.input_ids, r2.loss_mask) if m]) == (
        "Hello there!<|im_end|>Sure: 1, 2, 3.<|im_end|>"
    )
