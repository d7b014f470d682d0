"""The draft vocabulary: the target ids the drafter's lm_head covers, chosen by how often they
appear in assistant (loss-masked) tokens of the training data; stored as d2t/t2d.

Public bugs this guards against: d2t not saved (acceptance collapse), d2t rebuilt while
fine-tuning a drafter (lm_head rows misaligned), draft vocab larger than the distinct tokens seen
(crash). The last is handled by filling with the most frequent tokens overall, then low ids.
"""

from __future__ import annotations

import torch


def count_tokens(samples, vocab_size: int, chunk: int = 1 << 22) -> tuple[torch.Tensor, torch.Tensor]:
    """(assistant-token counts, all-token counts), both int64 [vocab_size]. Samples are gathered
    into chunks of ~`chunk` tokens and each chunk counted by one bincount: two counts of the whole
    vocab per sample are ~4 parallel regions over vocab_size each, which a host shared with other
    processes turns from seconds into minutes."""
    masked = torch.zeros(vocab_size, dtype=torch.long)
    every = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in _chunks(samples, chunk):
        every += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
        masked += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return masked, every


def _chunks(samples, tokens: int):
    """(input_ids, loss_mask) of consecutive samples, concatenated until they hold >= `tokens`."""
    ids, mask, held = [], [], 0
    for s in samples:
        ids.append(torch.as_tensor(s["input_ids"]).long().reshape(-1))
        mask.append(torch.as_tensor(s["loss_mask"]).bool().reshape(-1))
        held += len(ids[-1])
        if held >= tokens:
            yield torch.cat(ids), torch.cat(mask)
            ids, mask, held = [], [], 0
    if ids:
        yield torch.cat(ids), torch.cat(mask)


def build_draft_vocab(masked_counts: torch.Tensor, draft_vocab_size: int,
                      all_counts: torch.Tensor | None = None, always: tuple[int, ...] = ()) -> torch.Tensor:
    """Ascending target ids of the draft vocab (exactly `draft_vocab_size` of them)."""
    vocab = masked_counts.numel()
    n = min(draft_vocab_size, vocab)
    # Rank: forced ids first (EOS: the drafter must be able to propose stopping), then assistant
    # frequency, then overall frequency, then low ids as a deterministic tie-break.
    score = masked_counts.double() * (vocab + 1.0)
    if all_counts is not None:
        score = score + all_counts.double() / (all_counts.max().double() + 1.0)
    score = score + (vocab - torch.arange(vocab, dtype=torch.double)) / (vocab * (vocab + 1.0) * 10)
    for t in always:
        if 0 <= t < vocab:
            score[t] = float("inf")
    chosen = score.topk(n).indices
    return chosen.sort().values


def coverage(masked_counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of assistant tokens the draft vocab can propose at all."""
    total = masked_counts.sum().item()
    return float(masked_counts[ids].sum().item() / total) if total else 0.0
