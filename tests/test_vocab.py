"""The draft vocabulary's counts and choice (train/vocab.py)."""

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.train.vocab import build_draft_vocab, count_tokens

VOCAB = 40

samples_st = st.lists(
    st.lists(st.tuples(st.integers(0, VOCAB + 5), st.booleans()), min_size=0, max_size=30), min_size=0, max_size=12)


@settings(max_examples=60, deadline=None)
@given(samples=samples_st, chunk=st.sampled_from([1, 7, 50, 1 << 22]))
def test_counts_are_the_per_token_counts_whatever_the_chunking(samples, chunk):
    """Counted in chunks of any size, the counts are those of every token and of the assistant
    (masked) ones; ids past the vocab (added tokens) are not counted."""
    data = [{"input_ids": [i for i, _ in s], "loss_mask": [int(m) for _, m in s]} for s in samples]
    masked, every = count_tokens(iter(data), VOCAB, chunk=chunk)
    want_every = Counter(i for s in samples for i, _ in s if i < VOCAB)
    want_masked = Counter(i for s in samples for i, m in s if m and i < VOCAB)
    assert masked.dtype == every.dtype == torch.long and masked.shape == every.shape == (VOCAB,)
    assert every.tolist() == [want_every[i] for i in range(VOCAB)]
    assert masked.tolist() == [want_masked[i] for i in range(VOCAB)]


def test_the_draft_vocab_takes_eos_then_assistant_then_overall_frequency():
    masked = torch.zeros(VOCAB, dtype=torch.long)
    every = torch.zeros(VOCAB, dtype=torch.long)
    masked[[5, 9, 12]] = torch.tensor([10, 30, 20])
    every[[5, 9, 12, 3, 7]] = torch.tensor([10, 30, 20, 50, 40])
    ids = build_draft_vocab(masked, 6, every, always=(0,))
    # EOS (0) forced; assistant tokens 9, 12, 5; then 3 and 7 by overall frequency; ascending.
    assert ids.tolist() == [0, 3, 5, 7, 9, 12]
    # More asked than tokens seen: filled with the lowest unseen ids, exactly the size asked.
    assert build_draft_vocab(masked, 8, every).tolist() == [0, 1, 2, 3, 5, 7, 9, 12]
