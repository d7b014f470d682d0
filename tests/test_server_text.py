"""Incremental detokenization and stop strings of the server (specdec.server.text), in-process."""

import pytest

from specdec.models.tiny import byte_tokenizer
from specdec.server.text import TextStream


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def ids(tok, s: str) -> list[int]:
    return tok(s, add_special_tokens=False)["input_ids"]


def stream_all(tok, text: str, stop=None, chunk=1) -> tuple[list[str], TextStream]:
    ts = TextStream(tok, stop)
    toks = ids(tok, text)
    out = [ts.push(toks[i : i + chunk]) for i in range(0, len(toks), chunk)]
    out.append(ts.finish())
    return out, ts


def test_multibyte_characters_are_never_split(tok):
    text = "héllo 炒饭 🙂!"
    assert len(ids(tok, text)) == len(text.encode())  # one token per byte: every char >1 byte is split
    pieces, _ = stream_all(tok, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # The emoji's 4 bytes arrive one token at a time; it is emitted whole, on its last byte.
    assert "🙂" in pieces


def test_stop_string_is_excluded_and_ends_the_stream(tok):
    pieces, ts = stream_all(tok, "one two STOP three", stop=["STOP"])
    assert "".join(pieces) == "one two "
    assert ts.stopped
    assert ts.push(ids(tok, "more")) == ""


def test_partial_stop_prefix_is_held_back_then_released(tok):
    ts = TextStream(tok, ["STOP"])
    assert ts.push(ids(tok, "abc ST")) == "abc "  # "ST" might begin STOP
    assert ts.push(ids(tok, "AR")) == "STAR"  # it did not
    assert not ts.stopped


def test_stop_string_straddling_steps_and_earliest_of_several(tok):
    pieces, ts = stream_all(tok, "xx<end>yy##zz", stop=["##", "<end>"], chunk=3)
    assert "".join(pieces) == "xx"
    assert ts.stopped


def test_stop_with_multibyte_text(tok):
    pieces, _ = stream_all(tok, "café。终了。", stop=["。"])
    assert "".join(pieces) == "café"


def test_incomplete_character_at_the_end_is_flushed(tok):
    ts = TextStream(tok)
    assert ts.push(ids(tok, "ab")) == "ab"
    # A lone lead byte decodes to U+FFFD: held back while generation goes on, flushed at the end.
    assert ts.push(ids(tok, "é")[:1]) == ""
    assert ts.finish() == "\ufffd"
