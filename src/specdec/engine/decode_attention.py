"""One-token attention on CUDA as two Triton kernels, for the fast path's plain decode step.

Written with the compiled step's ops, a one-token layer's attention is q @ K^T over the whole
static cache, mask + softmax and p @ V: kernels of a few microseconds each, whose launches and
gaps in the CUDA graph cost as much as their work, and q @ K^T reads every slot, live or not.
Here, after the step has roped the token's queries and key and written its key and value into
the cache:

    split kernel    grid (kv heads, cache blocks of BLOCK_S slots). Every program scores its G query
                    heads (padded to 16 rows: two tensor-core products) against the slots of its
                    block up to the token's own (blocks past it load nothing) and writes an
                    unnormalised partial: max, sum of exp, p @ V.
    combine kernel  grid (query heads): rescales the partials by their maxima and sums them
                    (flash-decoding's split-K softmax).

The cache write stays in the compiled step (an index_put inductor performs in place). A first
version wrote the token's key and value itself, as a `triton_op` mutating the caches; torch.compile
functionalizes such an op, and that version cost +0.28 ms per step on Llama-3.1-8B shapes (4.7 MB
of cache per layer) where it saved time on SmolLM2's 0.4 MB, as copies of the caches would (H200,
BENCHMARKS.md; the copies were inferred, not profiled). The token's slot is read on the device
(the step's staging buffer), so the step stays one CUDA graph. Registered with
`torch.library.triton_op` like gemv.py's kernels; under Triton's interpreter they run on CPU
tensors (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import torch

from .gemv import runs_on, triton

BLOCK_S = 32  # cache slots per split program: 1,152 slots x 8 kv heads = 288 programs on 8B shapes
COMBINE_CHUNK = 32  # partials summed per pass of the combine kernel

if triton is not None:
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def _split_kernel(Q, KC, VC, SLOT, PO, PM, PL, S, NSPLIT, scale,
                      HD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_S: tl.constexpr,
                      UPCAST: tl.constexpr):
        h = tl.program_id(0)
        sp = tl.program_id(1)
        slot = tl.load(SLOT)
        d = tl.arange(0, HD)
        # The G query heads of kv head h, padded to GP >= 16 rows so both products run on tensor
        # cores (the padding rows load nothing and are never stored).
        gi = tl.arange(0, GP)
        live = gi < G
        head = h * G + gi
        q = tl.load(Q + head[:, None] * HD + d[None, :], mask=live[:, None], other=0.0)
        # This block's slots up to the token's own.
        j = sp * BLOCK_S + tl.arange(0, BLOCK_S)
        valid = j <= slot
        rows = h * S * HD + j[:, None] * HD + d[None, :]
        k = tl.load(KC + rows, mask=valid[:, None], other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bf16 tiles wrongly; fp32 ones exactly
            q, k = q.to(tl.float32), k.to(tl.float32)
        sc = tl.dot(q, tl.trans(k)) * scale  # shape: [GP, BLOCK_S], fp32
        sc = tl.where(valid[None, :], sc, float("-inf"))
        m = tl.max(sc, axis=1)
        shift = tl.where(m == float("-inf"), 0.0, m)  # a block past the token: every p is exp(-inf) = 0
        p = tl.exp(sc - shift[:, None])
        v = tl.load(VC + rows, mask=valid[:, None], other=0.0)
        pv = p.to(v.dtype)  # rounded as the GPU rounds it
        if UPCAST:
            pv, v = pv.to(tl.float32), v.to(tl.float32)
        o = tl.dot(pv, v)  # shape: [GP, HD], fp32
        tl.store(PO + (head[:, None] * NSPLIT + sp) * HD + d[None, :], o, mask=live[:, None])
        tl.store(PM + head * NSPLIT + sp, m, mask=live)
        tl.store(PL + head * NSPLIT + sp, tl.sum(p, axis=1), mask=live)

    @triton.jit
    def _combine_kernel(PO, PM, PL, OUT, NSPLIT, HD: tl.constexpr, SP: tl.constexpr, CHUNK: tl.constexpr):
        hh = tl.program_id(0)
        si = tl.arange(0, SP)
        m = tl.load(PM + hh * NSPLIT + si, mask=si < NSPLIT, other=float("-inf"))
        top = tl.max(m, axis=0)  # finite: block 0 always holds slot 0
        total = tl.sum(tl.exp(m - top) * tl.load(PL + hh * NSPLIT + si, mask=si < NSPLIT, other=0.0), axis=0)
        dd = tl.arange(0, HD)
        acc = tl.zeros((HD,), dtype=tl.float32)
        for c in range(0, NSPLIT, CHUNK):
            ci = c + tl.arange(0, CHUNK)
            keep = ci < NSPLIT
            w = tl.exp(tl.load(PM + hh * NSPLIT + ci, mask=keep, other=float("-inf")) - top)
            o = tl.load(PO + (hh * NSPLIT + ci)[:, None] * HD + dd[None, :], mask=keep[:, None], other=0.0)
            acc += tl.sum(w[:, None] * o, axis=0)
        tl.store(OUT + hh * HD + dd, (acc / total).to(OUT.dtype.element_ty))

    @triton_op("specdec::decode_attention", mutates_args={})
    def decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slot: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """Attention of one token over the cache: q its roped queries [heads, hd] (contiguous),
        kc/vc the caches [kv, S, hd] holding slots <= slot[0], the token's own included.
        Returns [1, heads * hd] in q's dtype."""
        heads, hd = q.shape
        nkv, S, _ = kc.shape
        g = heads // nkv
        nsplit = triton.cdiv(S, BLOCK_S)
        po = torch.empty(heads, nsplit, hd, device=q.device, dtype=torch.float32)
        pm = torch.empty(heads, nsplit, device=q.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
        out = torch.empty(1, heads * hd, device=q.device, dtype=q.dtype)
        wrap_triton(_split_kernel)[(nkv, nsplit)](
            q, kc, vc, slot, po, pm, pl, S, nsplit, scale,
            HD=hd, G=g, GP=max(16, triton.next_power_of_2(g)), BLOCK_S=BLOCK_S, UPCAST=not q.is_cuda, num_warps=4)
        wrap_triton(_combine_kernel)[(heads,)](
            po, pm, pl, out, nsplit, HD=hd, SP=triton.next_power_of_2(nsplit), CHUNK=COMBINE_CHUNK, num_warps=4)
        return out


def fits(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> bool:
    """Whether the kernels apply: one bf16/fp16 token where Triton runs, a head size that is a
    power of two of at least 16 (tensor-core tiles), caches of the token's dtype. Shapes, dtypes
    and devices only, so under torch.compile it resolves while tracing."""
    hd = kc.shape[-1]
    return (runs_on(q) and q.shape[0] == 1 and kc.dtype == vc.dtype == q.dtype
            and kc.is_contiguous() and vc.is_contiguous() and hd >= 16 and hd & (hd - 1) == 0)
