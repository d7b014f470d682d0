"""Run the target over rendered conversations and keep what EAGLE-3 training needs.

`forward_padded` is the one forward pass that turns rendered conversations into training tensors;
the online trainer (`train --online`) calls it through `capture_batch`, and the offline path
(`run_capture`, which writes shards) calls it directly, so the two see identical data. Offline,
each batch's states are copied to pinned host memory on a side stream and written by a writer
thread, so the GPU computes the next batch meanwhile.

Batches are right-padded: with causal attention a real token never sees the padding after it and
its positions are unchanged, so no attention mask is needed and the states equal those of an
unpadded forward. Only the last position's logits are computed (`logits_to_keep=1`): the loss
recomputes the target distribution from `last_hidden`, so full [T, vocab] logits are never made.

Examples:
    specdec capture --target tiny-llama --data regen.jsonl -o runs/cap --max-length 512
    specdec capture --target smollm2-135m-instruct --data regen.jsonl -o runs/cap
    torchrun --nproc-per-node 8 -m specdec capture --target T --data regen.jsonl -o runs/cap
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.nn.attention import sdpa_kernel

from ..errors import SpecdecError
from ..models.drafter import NO_CUDNN
from ..shape_graphs import ShapeGraphs
from . import store as st


@dataclass(frozen=True)
class Item:
    """One rendered sample, ready to capture."""

    id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]

    def __len__(self) -> int:
        return len(self.input_ids)


def _ids_and_mask(r) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(r, dict):
        ids, mask = r["input_ids"], r["loss_mask"]
    else:
        ids, mask = r.input_ids, r.loss_mask
    return torch.as_tensor(np.asarray(ids), dtype=torch.long), torch.as_tensor(np.asarray(mask), dtype=torch.uint8)


@dataclass
class Padded:
    """One forward pass's states, still padded: aux [B, T, 3H], last [B, T, H]. When they are
    being copied to host memory asynchronously, `event` marks the end of the copy and `keep`
    holds the device tensors until then."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # per sample: (ids int64 [n], mask uint8 [n]) on CPU
    aux: torch.Tensor
    last: torch.Tensor
    event: "torch.cuda.Event | None" = None
    keep: tuple = ()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.event, self.keep = None, ()

    def split(self, device: str | torch.device | None = None) -> list[dict[str, torch.Tensor]]:
        self.wait()
        aux, last = self.aux, self.last
        if device is not None:
            aux, last = aux.to(device), last.to(device)
        dev = aux.device
        return [
            {"input_ids": i.to(dev, torch.int32), "loss_mask": m.to(dev),
             "aux_hidden": aux[b, : len(i)], "last_hidden": last[b, : len(i)]}
            for b, (i, m) in enumerate(self.pairs)
        ]  # fmt: skip


def _states(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's aux and final pre-norm states of right-padded `ids` [B, T] on its device."""
    with sdpa_kernel(NO_CUDNN):  # every batch a new shape: cuDNN would plan each layer's attention anew
        out = target.forward(ids, capture=True, logits_to_keep=1)
    return out.aux_hidden, out.last_hidden


class RecordedForward:
    """`_states` recorded as one CUDA graph per padded batch shape and replayed (ShapeGraphs), one
    set of graphs per calling thread (online training captures in its prefetch thread and, for
    held-out batches, in the main one). Where a recording fails, the forward runs eagerly from
    then on: it is the same computation, only launched from the host."""

    def __init__(self, target):
        self.target = target
        self._local = threading.local()
        self.failed: str | None = None
        self.shapes: set[tuple[int, int]] = set()  # recorded, in any thread

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.failed is None:
            graphs = getattr(self._local, "graphs", None)
            if graphs is None:
                graphs = self._local.graphs = ShapeGraphs(lambda inputs: _states(self.target, *inputs),
                                                          self.target.device)
            try:
                states = graphs((ids,))
                self.shapes.add(tuple(ids.shape))
                return states
            except SpecdecError as e:
                self.failed = str(e)
                print(f"specdec: the target's forward runs eagerly from now on: {e}", file=sys.stderr, flush=True)
        return _states(self.target, ids)


@torch.no_grad()
def forward_padded(target, batch_of_rendered: Sequence, dtype: torch.dtype | str = torch.bfloat16, *,
                   max_length: int | None = None, shape: tuple[int, int] | None = None,
                   recorded: RecordedForward | None = None) -> Padded:
    """The one forward pass behind every capture (online and offline): right-padded ids, the
    target's aux and final pre-norm states cast to `dtype`, left on the target's device. `shape`
    (rows, length): pad to it (rows of padding only) where it is larger, so that `recorded` replays
    one graph per shape; the states of the real rows and tokens are the same either way, up to the
    last bit in bf16 on CUDA, where another shape may run other kernels."""
    dtype = st.parse_dtype(dtype)
    pairs = [_ids_and_mask(r) for r in batch_of_rendered]
    if max_length:
        pairs = [(i[:max_length], m[:max_length]) for i, m in pairs]
    if not pairs:
        raise SpecdecError("capture got an empty batch; expected at least one sample")
    lengths = [len(i) for i, _ in pairs]
    if min(lengths) == 0:
        raise SpecdecError("capture got an empty sample; expected at least one token each")
    rows, length = len(pairs), max(lengths)
    if shape is not None:
        rows, length = max(rows, shape[0]), max(length, shape[1])
    ids = torch.zeros(rows, length, dtype=torch.long)
    for b, (i, _) in enumerate(pairs):
        ids[b, : len(i)] = i
    ids = ids.to(target.device)
    aux, last = recorded(ids) if recorded is not None else _states(target, ids)
    return Padded(pairs, aux.to(dtype), last.to(dtype))  # shapes: [B, T, 3H], [B, T, H]


def to_host_async(p: Padded, stream: "torch.cuda.Stream") -> Padded:
    """Start copying a batch's states into pinned host memory on `stream`, so the next forward
    pass overlaps the device-to-host copy (a plain .cpu() stalls the GPU for the whole copy)."""
    stream.wait_stream(torch.cuda.current_stream(p.aux.device))
    with torch.cuda.stream(stream):
        aux = torch.empty(p.aux.shape, dtype=p.aux.dtype, pin_memory=True)
        last = torch.empty(p.last.shape, dtype=p.last.dtype, pin_memory=True)
        aux.copy_(p.aux, non_blocking=True)
        last.copy_(p.last, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return Padded(p.pairs, aux, last, event, keep=(p.aux, p.last))


def capture_batch(
    target,
    batch_of_rendered: Sequence,
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    max_length: int | None = None,
    device: str | torch.device | None = None,
    shape: tuple[int, int] | None = None,
    recorded: RecordedForward | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Per sample: input_ids int32 [T], loss_mask uint8 [T], aux_hidden [T, 3H] and
    last_hidden [T, H] in `dtype`.

    `batch_of_rendered`: `chat.Rendered` objects (or anything with input_ids / loss_mask, or
    such dicts). Samples are truncated to `max_length`. Tensors stay on the target's device
    unless `device` is given (the whole padded batch is moved once, then split). `shape` and
    `recorded`: see forward_padded.
    """
    if not batch_of_rendered:
        return []
    return forward_padded(target, batch_of_rendered, dtype, max_length=max_length, shape=shape,
                          recorded=recorded).split(device)


def capture_identity(target, dtype: torch.dtype, max_length: int | None) -> dict:
    """The manifest fields that say what produced a capture (checked before appending)."""
    tok = target.tokenizer
    eos = list(target.eos_token_ids)
    return {
        "target": target.name,
        "target_fingerprint": target.fingerprint(),
        "aux_layer_ids": list(target.aux_layer_ids),
        "layer_convention": "eagle",  # canonical: id k = HF hidden_states[k] = input of layer k
        "last_state": target.last_state,
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "model_dtype": st.dtype_name(target.dtype),
        "dtype": st.dtype_name(dtype),
        "max_length": max_length,
        "tokenizer_fingerprint": st.tokenizer_fingerprint(tok, eos) if tok is not None else None,
        "eos_token_ids": eos,
        "tensors": {"offsets": "int64 [n+1]", "input_ids": "int32 [N]", "loss_mask": "uint8 [N]",
                    "aux_hidden": f"{st.dtype_name(dtype)} [N, {3 * target.hidden_size}]",
                    "last_hidden": f"{st.dtype_name(dtype)} [N, {target.hidden_size}] (pre-norm)"},
    }


# -- data ----------------------------------------------------------------------------------


def load_records(path: str) -> list[dict]:
    """Conversations to capture: a regenerate JSONL (records with id + messages), or any source
    `specdec.data.datasets.load_conversations` reads."""
    p = Path(path).expanduser()
    if p.suffix == ".jsonl" and p.exists():
        from ..atomic import read_jsonl

        recs = read_jsonl(p)
        if recs and all("messages" in r and "id" in r for r in recs):
            return [{"id": str(r["id"]), "messages": r["messages"]} for r in recs]
    from ..data.datasets import load_conversations

    return [{"id": c.id, "messages": c.messages} for c in load_conversations(str(path))]


@dataclass
class Prepared:
    items: list[Item]
    skipped_no_loss: int = 0
    truncated: int = 0
    already_done: int = 0
    other_ranks: int = 0


def prepare(records: Sequence[dict], tokenizer, *, max_length: int | None, done: set[str],
            rank: int = 0, world_size: int = 1, progress: bool = True) -> Prepared:
    """Render this rank's share (record i goes to rank i % world_size) minus what is done."""
    from ..data.chat import render

    out = Prepared(items=[])
    mine = []
    for i, r in enumerate(records):
        if i % world_size != rank:
            out.other_ranks += 1
        elif str(r["id"]) in done:
            out.already_done += 1
        else:
            mine.append(r)
    with _progress(progress and rank == 0) as prog:
        task = prog.add_task("rendering", total=len(mine), rate="")
        for r in mine:
            prog.advance(task)
            if not any(m["role"] == "assistant" for m in r["messages"]):
                out.skipped_no_loss += 1
                continue
            rd = render(tokenizer, r["messages"])
            ids, mask = rd.input_ids, rd.loss_mask
            if max_length and len(ids) > max_length:
                ids, mask = ids[:max_length], mask[:max_length]
                out.truncated += 1
            if not any(mask):
                out.skipped_no_loss += 1
                continue
            out.items.append(Item(str(r["id"]), np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
    return out


def plan_shards(items: list[Item], shard_tokens: int) -> list[list[Item]]:
    """Longest first (an out-of-memory shows in the first batch, not hours later), cut into shards
    of at least `shard_tokens` tokens (the last one smaller)."""
    order = sorted(items, key=len, reverse=True)
    shards, cur, n = [], [], 0
    for it in order:
        cur.append(it)
        n += len(it)
        if n >= shard_tokens:
            shards.append(cur)
            cur, n = [], 0
    if cur:
        shards.append(cur)
    return shards


# -- the offline capture -------------------------------------------------------------------


@dataclass
class CaptureSummary:
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    bytes: int = 0
    shards: int = 0
    seconds: float = 0.0
    skipped_done: int = 0
    skipped_no_loss: int = 0
    truncated: int = 0
    removed_orphans: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def run_capture(
    target,
    records: Sequence[dict],
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    shard_tokens: int = 1_000_000,
    max_length: int | None = 2048,
    batch_size: int = 8,
    batch_tokens: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
    check_space: bool = True,
    log=None,
) -> CaptureSummary:
    """Capture `records` ({id, messages}) into `out_dir`, resuming what a previous run did.

    With world_size > 1 this rank takes records i % world_size == rank and names its shards
    `shard-r<rank>-NNNNN`; all ranks share one manifest (updated under a file lock).
    """
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    say = log if rank == 0 else (lambda s: None)
    dtype = st.parse_dtype(dtype)
    if target.tokenizer is None:
        raise SpecdecError("the target has no tokenizer; capture renders conversations with its chat template")
    out_dir = Path(out_dir)
    identity = capture_identity(target, dtype, max_length)
    manifest = st.open_or_create_manifest(out_dir, identity)
    summary = CaptureSummary()
    summary.removed_orphans = st.clean_orphans(out_dir, manifest, rank, world_size)
    if summary.removed_orphans:
        log(f"rank {rank}: removed {len(summary.removed_orphans)} incomplete shard file(s) left by a killed run")
    done = st.done_sample_ids(manifest)
    prep = prepare(records, target.tokenizer, max_length=max_length, done=done, rank=rank,
                   world_size=world_size, progress=progress)
    summary.skipped_done, summary.skipped_no_loss, summary.truncated = (
        prep.already_done, prep.skipped_no_loss, prep.truncated
    )

    bpt = st.bytes_per_token(target.hidden_size, dtype, len(target.aux_layer_ids))
    tokens = sum(len(it) for it in prep.items)
    projected = bpt * tokens * world_size  # other ranks' shares are about as large
    free = shutil.disk_usage(out_dir).free
    H, E = target.hidden_size, torch.empty((), dtype=dtype).element_size()
    say(f"capture: {bpt:,} bytes/token (ids 4 + mask 1 + aux 3x{H}x{E} + last {H}x{E}); "
        f"{len(prep.items) * (world_size if world_size > 1 else 1):,} samples to capture"
        f"{' (about, all ranks)' if world_size > 1 else ''}, {tokens * world_size:,} tokens -> "
        f"{st.human_bytes(projected)} projected, {st.human_bytes(free)} free on {out_dir}")
    if done:
        say(f"capture: resuming: {prep.already_done:,} of this rank's samples already captured "
            f"({manifest['num_samples']:,} samples, {len(manifest['shards'])} shards in total)")
    if prep.truncated:
        say(f"capture: {prep.truncated:,} samples truncated to --max-length {max_length}")
    if prep.skipped_no_loss:
        say(f"capture: {prep.skipped_no_loss:,} samples skipped: no assistant tokens to learn from")
    if check_space and projected > free:
        raise SpecdecError(
            f"capture needs about {st.human_bytes(projected)} ({tokens * world_size:,} tokens x "
            f"{bpt:,} bytes) but {out_dir} has {st.human_bytes(free)} free; free space, capture "
            f"to a larger disk, or lower --max-length / --limit"
        )

    shards = plan_shards(prep.items, shard_tokens)
    first_index = st.next_shard_index(out_dir, manifest, rank, world_size)
    meta = {"target": str(target.name), "target_fingerprint": identity["target_fingerprint"],
            "aux_layer_ids": str(identity["aux_layer_ids"])}
    copy_stream = torch.cuda.Stream(target.device) if target.device.type == "cuda" else None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
    pending: list[Future] = []

    def drain(keep: int) -> None:
        while len(pending) > keep:
            pending.pop(0).result()

    t0 = time.perf_counter()
    writers: list[st.ShardWriter] = []
    try:
        with _progress(progress and rank == 0) as prog:
            task = prog.add_task(f"capturing{f' (rank 0 of {world_size})' if world_size > 1 else ''}",
                                 total=tokens, rate="")
            for k, shard in enumerate(shards):
                path = out_dir / st.shard_name(rank, world_size, first_index + k)
                writer = st.ShardWriter(path, [it.id for it in shard], [len(it) for it in shard],
                                        hidden_size=H, num_aux=len(target.aux_layer_ids), dtype=dtype,
                                        metadata=meta)
                writers.append(writer)
                for batch in _batches(shard, batch_size, batch_tokens):
                    padded = forward_padded(target, batch, dtype)
                    if copy_stream is not None:
                        padded = to_host_async(padded, copy_stream)
                    drain(1)  # at most one batch being copied/written while the next one computes
                    pending.append(pool.submit(_write_all, writer, padded))
                    n = sum(len(it) for it in batch)
                    summary.tokens += n
                    summary.samples += len(batch)
                    el = time.perf_counter() - t0
                    prog.update(task, advance=n, rate=f"{summary.tokens / el:,.0f} tok/s" if el > 0 else "")
                pending.append(pool.submit(_finish_shard, writer, out_dir))
                drain(1)
                summary.bytes += writer.nbytes
                summary.shards += 1
            drain(0)
    except BaseException:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True)
        for w in writers:
            w.abort()  # unfinished shards leave no temporary files behind
        raise
    pool.shutdown(wait=True)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    summary.seconds = time.perf_counter() - t0
    summary.loss_tokens = sum(int(it.loss_mask.sum()) for it in prep.items)
    return summary


def _write_all(writer: st.ShardWriter, padded: Padded) -> None:
    for s in padded.split():
        writer.write(s)


def _finish_shard(writer: st.ShardWriter, out_dir: Path) -> None:
    entry = writer.close()
    st.add_shard(out_dir, entry)


def _batches(items: list[Item], batch_size: int, batch_tokens: int | None):
    """Consecutive items (already sorted by length) in batches of at most `batch_size` samples
    and, if set, `batch_tokens` padded tokens."""
    cur: list[Item] = []
    for it in items:
        width = max([len(it)] + [len(c) for c in cur])
        if cur and (len(cur) >= batch_size or (batch_tokens and width * (len(cur) + 1) > batch_tokens)):
            yield cur
            cur = []
        cur.append(it)
    if cur:
        yield cur


def _progress(enabled: bool):
    from ..progress import progress_bar

    return progress_bar(enabled=enabled)
