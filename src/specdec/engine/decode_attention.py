"""Attention of a step's few tokens on CUDA as two Triton kernels: the fast path's one-token decode
step, and verify steps whose query rows (tokens x query heads per kv head) fit in
KernelConfig.attention_max_rows.

Written with the compiled step's ops, a layer's attention is rope on the queries, q @ K^T over the
whole static cache, mask + softmax and p @ V: kernels of a few microseconds each, whose launches
and gaps in the CUDA graph cost as much as their work, and q @ K^T reads every slot, live or not.
Here, after the step has roped the tokens' keys and written keys and values into the cache (one
kernel: the caches of a layer are one tensor [2, kv heads, slots, head size]):

    split kernel    grid (kv heads, cache blocks of `block` slots). Every program takes the G query
                    heads of its kv head for each of the T tokens (G*T rows, padded to at least 16
                    so both products run on tensor cores), ropes them from the q/k/v product's
                    output as HF does (each product rounded to the model's dtype), scores them
                    against its block's slots (the cache before the step, and the step's own slots
                    its tree mask allows; blocks past the step load nothing) and writes an
                    unnormalised partial per row: max, sum of exp, p @ V (blocks past the step
                    store nothing).
    combine kernel  grid (tokens x query heads): rescales the partials of the blocks up to the
                    step's by their maxima and sums them (flash-decoding's split-K softmax).

The cache write stays in the compiled step (an index_put inductor performs in place). Writing the
token's key and value here instead, as a `triton_op` mutating the caches, would have torch.compile
functionalize the op, at a cost that grows with the cache per layer as copies of the caches would:
small models gain, 8B-sized caches lose. The step's first slot and its tree mask are read on the
device (the step's staging buffer), so the step stays one CUDA graph. Registered with
`torch.library.triton_op` like gemv.py's kernels; under Triton's interpreter they run on CPU
tensors (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import torch

from .gemv import runs_on, triton
from .config import KernelConfig

if triton is not None:
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def _split_kernel(QKV, COS, SIN, KV, SLOTS, TM, PO, PM, PL, QSTRIDE, VOFF, S, NSPLIT, scale,
                      T: tl.constexpr, HEADS: tl.constexpr, HD: tl.constexpr, G: tl.constexpr,
                      GP: tl.constexpr, BLOCK_S: tl.constexpr, UPCAST: tl.constexpr):
        h = tl.program_id(0)
        sp = tl.program_id(1)
        slot0 = tl.load(SLOTS)
        # Row r is query head h * G + r % G of token r // G; rows past G * T pad to GP and load nothing.
        r = tl.arange(0, GP)
        t = r // G
        head = h * G + r % G
        live = (r < G * T)[:, None]
        d = tl.arange(0, HD)
        half = HD // 2
        at = (t * QSTRIDE + head * HD)[:, None]
        q = tl.load(QKV + at + d[None, :], mask=live, other=0.0)
        # rotate_half(q)[d] = -q[d + HD/2] for d < HD/2, q[d - HD/2] after
        rot = tl.load(QKV + at + ((d + half) % HD)[None, :], mask=live, other=0.0).to(tl.float32)
        rot = rot * tl.where(d < half, -1.0, 1.0)[None, :]
        c = tl.load(COS + t[:, None] * HD + d[None, :], mask=live, other=0.0).to(tl.float32)
        s = tl.load(SIN + t[:, None] * HD + d[None, :], mask=live, other=0.0).to(tl.float32)
        # HF's rounding: q * cos and rotate_half(q) * sin each rounded to the model's dtype, then the sum
        dt = q.dtype
        q = ((q.to(tl.float32) * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)).to(dt)
        # This block's slots: the cache before the step (j < slot0) and the step's own T slots.
        j = sp * BLOCK_S + tl.arange(0, BLOCK_S)
        valid = j < slot0 + T
        rows = h * S * HD + j[:, None] * HD + d[None, :]
        k = tl.load(KV + rows, mask=valid[:, None], other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bf16 tiles wrongly; fp32 ones exactly
            q, k = q.to(tl.float32), k.to(tl.float32)
        sc = tl.dot(q, tl.trans(k)) * scale  # shape: [GP, BLOCK_S], fp32
        if T == 1:
            allowed = valid[None, :]
        else:  # in-step slot slot0 + c is visible to token t where its tree mask says so
            rel = j - slot0
            step = (rel >= 0) & valid
            seen = tl.load(TM + t[:, None] * T + rel[None, :], mask=live & step[None, :], other=0)
            allowed = (rel < 0)[None, :] | (seen != 0)
        sc = tl.where(allowed, sc, float("-inf"))
        m = tl.max(sc, axis=1)
        shift = tl.where(m == float("-inf"), 0.0, m)  # a row that sees nothing here: every p is exp(-inf) = 0
        p = tl.exp(sc - shift[:, None])
        v = tl.load(KV + VOFF + rows, mask=valid[:, None], other=0.0)
        pv = p.to(v.dtype)  # rounded as the GPU rounds it
        if UPCAST:
            pv, v = pv.to(tl.float32), v.to(tl.float32)
        o = tl.dot(pv, v)  # shape: [GP, HD], fp32
        out = t * HEADS + head  # the output row [T * HEADS] of this query row
        # A block past the step stores nothing (its rows count as none): the combine skips it.
        stored = r < tl.where(sp * BLOCK_S < slot0 + T, G * T, 0)
        tl.store(PO + (out[:, None] * NSPLIT + sp) * HD + d[None, :], o, mask=stored[:, None])
        tl.store(PM + out * NSPLIT + sp, m, mask=stored)
        tl.store(PL + out * NSPLIT + sp, tl.sum(p, axis=1), mask=stored)

    @triton.jit
    def _combine_kernel(PO, PM, PL, OUT, SLOTS, NSPLIT, T: tl.constexpr, BLOCK_S: tl.constexpr,
                        HD: tl.constexpr, SP: tl.constexpr, CHUNK: tl.constexpr):
        hh = tl.program_id(0)
        nlive = (tl.load(SLOTS) + T + BLOCK_S - 1) // BLOCK_S  # the blocks the split kernel stored
        si = tl.arange(0, SP)
        m = tl.load(PM + hh * NSPLIT + si, mask=si < nlive, other=float("-inf"))
        top = tl.max(m, axis=0)  # finite: every token sees slot 0 (the cache's first or the step's root)
        total = tl.sum(tl.exp(m - top) * tl.load(PL + hh * NSPLIT + si, mask=si < nlive, other=0.0), axis=0)
        dd = tl.arange(0, HD)
        acc = tl.zeros((HD,), dtype=tl.float32)
        for c in range(0, nlive, CHUNK):
            ci = c + tl.arange(0, CHUNK)
            keep = ci < nlive
            w = tl.exp(tl.load(PM + hh * NSPLIT + ci, mask=keep, other=float("-inf")) - top)
            o = tl.load(PO + (hh * NSPLIT + ci)[:, None] * HD + dd[None, :], mask=keep[:, None], other=0.0)
            acc += tl.sum(w[:, None] * o, axis=0)
        tl.store(OUT + hh * HD + dd, (acc / total).to(OUT.dtype.element_ty))

    @triton_op("specdec::decode_attention", mutates_args={})
    def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                         slots: torch.Tensor, tm: torch.Tensor, heads: int, scale: float, block: int,
                         chunk: int) -> torch.Tensor:
        """Attention of a step's T tokens over the cache. qkv [T, >= heads * hd] holds their queries,
        not yet roped, in its first heads * hd columns (contiguous); cos/sin [T, hd] their rope rows;
        kv [2, kv heads, S, hd] the caches, holding every slot before slots[0] and the step's T
        keys (roped) and values from slots[0] on; tm [T, T] the tree mask (nonzero: token t sees
        the step's token c; the lower triangle for a chain); `block` cache slots per split program
        and `chunk` partials per combine pass (`settings`). Returns [T, heads * hd] in qkv's dtype."""
        T = qkv.shape[0]
        _, nkv, S, hd = kv.shape
        g = heads // nkv
        nsplit = triton.cdiv(S, block)
        po = torch.empty(T * heads, nsplit, hd, device=qkv.device, dtype=torch.float32)
        pm = torch.empty(T * heads, nsplit, device=qkv.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
        out = torch.empty(T, heads * hd, device=qkv.device, dtype=qkv.dtype)
        wrap_triton(_split_kernel)[(nkv, nsplit)](
            qkv, cos, sin, kv, slots, tm, po, pm, pl, qkv.stride(0), nkv * S * hd, S, nsplit, scale,
            T=T, HEADS=heads, HD=hd, G=g, GP=max(16, triton.next_power_of_2(g * T)), BLOCK_S=block,
            UPCAST=not qkv.is_cuda, num_warps=4)
        wrap_triton(_combine_kernel)[(T * heads,)](
            po, pm, pl, out, slots, nsplit, T=T, BLOCK_S=block, HD=hd, SP=triton.next_power_of_2(nsplit),
            CHUNK=chunk, num_warps=4)
        return out


def settings(kernels: KernelConfig, tokens: int) -> tuple[int, int]:
    """The op's (block, chunk) for a step of `tokens` tokens. Arguments of the op rather than
    constants its body reads, so they key torch.compile's graph cache."""
    block = kernels.attention_block if tokens == 1 else kernels.attention_step_block
    return block, kernels.attention_combine_chunk


def fits(qkv: torch.Tensor, kv: torch.Tensor, heads: int, kernels: KernelConfig) -> bool:
    """Whether the kernels apply: bf16/fp16 tokens where Triton runs, at most
    kernels.attention_max_rows query rows per kv head, a head size that is a power of two of at
    least 16 (tensor-core tiles), caches of the tokens' dtype. Shapes, dtypes and devices only, so
    under torch.compile it resolves while tracing."""
    hd, nkv = kv.shape[-1], kv.shape[1]
    return (runs_on(qkv) and (heads // nkv) * qkv.shape[0] <= kernels.attention_max_rows
            and kv.dtype == qkv.dtype and qkv.is_contiguous() and kv.is_contiguous() and hd >= 16
            and hd & (hd - 1) == 0)
