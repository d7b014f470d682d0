"""Where training samples come from: a capture directory (offline), or regenerated
conversations run through the target on the fly (online, no disk). Both yield the same dicts
(input_ids, loss_mask, aux_hidden, last_hidden), made by the same capture code.

Batches are built globally (independent of the number of processes) and each process takes
every world_size-th sample of a batch, so `--resume` stays exact across a change of world size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def is_heldout(sample_id: str, percent: float) -> bool:
    h = int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16)
    return (h % 10_000) < percent * 100


@dataclass
class Source:
    ids: list[str]
    lengths: list[int]

    def get(self, indices: list[int], shape: tuple[int, int] | None = None) -> list[dict]:
        """The samples at `indices`. `shape` (rows, length): the padded shape the batch will train
        at, where its steps are recorded as CUDA graphs; a source that computes states may use it."""
        raise NotImplementedError

    def token_samples(self):
        """input_ids + loss_mask of every sample, for vocab counting."""
        raise NotImplementedError


class OfflineSource(Source):
    def __init__(self, store):
        self.store = store
        super().__init__(list(store.sample_ids), list(store.lengths()))

    def get(self, indices, shape=None):
        return [self.store.sample(i) for i in indices]

    def token_samples(self):
        for i in range(len(self.store)):
            yield self.store.sample(i, ("input_ids", "loss_mask"))  # not the hidden states: 1000x less to read


class OnlineSource(Source):
    """Rendered conversations run through the target batch by batch. Given a batch's padded
    `shape` on a GPU, the forward runs at that shape, recorded as one CUDA graph per shape and
    replayed (capture.run.RecordedForward): eager, a small target's forward is bound by the host's
    kernel launches, and it shares the host with the training step."""

    def __init__(self, target, rendered: list, ids: list[str], dtype, max_length: int | None):
        from ..capture.run import RecordedForward, capture_batch

        self._capture = capture_batch
        self.target, self.rendered, self.dtype, self.max_length = target, rendered, dtype, max_length
        self.recorded = RecordedForward(target) if target.device.type == "cuda" else None
        lengths = [min(len(r.input_ids), max_length or 1 << 30) for r in rendered]
        super().__init__(ids, lengths)

    def get(self, indices, shape=None):
        if not indices:
            return []
        if self.recorded is None:
            shape = None  # nothing replays here (no GPU): each batch runs at its own shape
        return self._capture(self.target, [self.rendered[i] for i in indices], self.dtype,
                             max_length=self.max_length, shape=shape, recorded=self.recorded if shape else None)

    def token_samples(self):
        for r in self.rendered:
            yield {"input_ids": torch.tensor(r.input_ids), "loss_mask": torch.tensor(r.loss_mask)}


def online_source(target, records: list[dict], max_length: int | None) -> OnlineSource:
    """An OnlineSource over regenerated `records` (dicts with "id" and "messages"): those with an
    assistant turn to learn from, their states in bf16 on a GPU (as a capture stores them) and in
    fp32 elsewhere."""
    from ..data.chat import render
    from ..errors import SpecdecError

    rendered, ids = [], []
    for r in records:
        rd = render(target.tokenizer, r["messages"])
        if sum(rd.loss_mask) and len(rd.input_ids) > 2:
            rendered.append(rd)
            ids.append(str(r["id"]))
    if not rendered:
        raise SpecdecError(f"none of the {len(records)} conversations has an assistant turn to learn from: "
                           "regenerate them with the target first (`specdec regenerate`)")
    dtype = torch.bfloat16 if target.device.type == "cuda" else torch.float32
    return OnlineSource(target, rendered, ids, dtype, max_length)


MAX_BATCH = 64  # rows per batch, whatever their length
GRAPH_LENGTH_MULTIPLE = 64  # the length bucket under CUDA graphs unless one is given


def padded_length(longest: int, multiple: int) -> int:
    return -(-longest // multiple) * multiple


def padded_shape(rows: int, longest: int, batch_tokens: int, multiple: int) -> tuple[int, int]:
    """(rows, length) a batch is padded to. With `multiple` > 1 its length rounds up to a multiple
    of it and its rows to as many as `batch_tokens` holds at that length (global_batches packs no
    more), so the shape depends on the length bucket alone: a run meets one shape per bucket, few
    enough to replay each as a CUDA graph. With 1, the batch's own shape."""
    if multiple <= 1:
        return rows, longest
    length = padded_length(longest, multiple)
    return max(rows, min(MAX_BATCH, batch_tokens // length)), length


def global_batches(indices: list[int], lengths: list[int], batch_tokens: int, *, seed: int, epoch: int,
                   max_batch: int = MAX_BATCH, multiple: int = 1) -> list[list[int]]:
    """Shuffle, then group neighbours of similar length into batches of <= batch_tokens padded
    tokens (the longest rounded up to `multiple`, see padded_shape). Deterministic in (seed,
    epoch), independent of world size."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
    # Sort within windows of 64 to cut padding while keeping the shuffle.
    window = 64
    order = [i for w in range(0, len(order), window) for i in sorted(order[w : w + window], key=lambda i: lengths[i])]
    batches, cur, cur_max = [], [], 0
    for i in order:
        length = padded_length(lengths[i], multiple)
        m = max(cur_max, length)
        if cur and (m * (len(cur) + 1) > batch_tokens or len(cur) >= max_batch):
            batches.append(cur)
            cur, m = [], length
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[p] for p in perm]


def batches_at(step: int, indices: list[int], lengths: list[int], batch_tokens: int, *, seed: int,
               multiple: int = 1) -> tuple[int, int, list[list[int]]]:
    """(epoch, position in it, that epoch's batches) of global optimizer step `step`.

    Epochs pack into different numbers of batches (the shuffle changes which lengths share a
    batch), so the step is located by walking the epochs' actual sizes, never by dividing by
    epoch 0's size: that leaves steps pointing past the end of a shorter epoch.
    """
    epoch, start = 0, 0
    while True:
        batches = global_batches(indices, lengths, batch_tokens, seed=seed, epoch=epoch, multiple=multiple)
        if step < start + len(batches):
            return epoch, step - start, batches
        start += len(batches)
        epoch += 1


def step_batches(step: int, total: int, indices: list[int], lengths: list[int], batch_tokens: int, *, seed: int,
                 multiple: int = 1):
    """The global batch of every optimizer step from `step` to `total`, across epochs."""
    epoch, pos, batches = batches_at(step, indices, lengths, batch_tokens, seed=seed, multiple=multiple)
    for _ in range(step, total):
        if pos >= len(batches):
            epoch, pos = epoch + 1, 0
            batches = global_batches(indices, lengths, batch_tokens, seed=seed, epoch=epoch, multiple=multiple)
        yield batches[pos]
        pos += 1
