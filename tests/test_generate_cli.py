"""`specdec generate` as a user runs it: text out, --json statistics, one-line errors."""

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def specdec(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "specdec", *args], capture_output=True, text=True,
                          env=ENV, timeout=timeout)


def test_json_keys_and_ngram_is_lossless(tiny_dirs):
    base = ["generate", "--target", str(tiny_dirs["qwen2"]), "--prompt", "abcabcabc", "--max-new-tokens", "24",
            "--json"]
    plain = specdec(*base)
    assert plain.returncode == 0, plain.stderr
    p = json.loads(plain.stdout)
    for key in ("text", "new_tokens", "seconds", "tokens_per_s", "drafted", "accepted", "acceptance_rate",
                "mean_acceptance_length", "per_position_acceptance"):
        assert key in p
    ngram = json.loads(specdec(*base, "--ngram", "3").stdout)
    assert ngram["text"] == p["text"]
    assert ngram["drafted"] > 0 and p["drafted"] == 0


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--target", "/no/such/model"], "no such model"),
        (["--target", "tiny-llama", "--drafter", "/no/such/drafter"], "no drafter at"),
        (["--target", "tiny-llama", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--target", "tiny-llama", "--ngram", "0"], "--ngram"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args, needle):
    r = specdec("generate", "--prompt", "hi", *args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.slow
def test_smollm2_plain_and_ngram_agree():
    """The real default model: coherent text, and n-gram speculation gives the same text."""
    base = ["generate", "--target", "smollm2-135m-instruct", "--prompt", "Explain what a hash table is.",
            "--max-new-tokens", "40", "--json"]
    plain = specdec(*base)
    assert plain.returncode == 0, plain.stderr
    text = json.loads(plain.stdout)["text"]
    assert "hash" in text.lower() and "table" in text.lower()
    ngram = json.loads(specdec(*base, "--ngram", "3").stdout)
    assert ngram["text"] == text
    assert ngram["drafted"] > 0
