"""One-token attention on CUDA as two Triton kernels, for the fast path's plain decode step.

Written with the compiled step's ops, a one-token layer's attention is q @ K^T over the whole
static cache, mask + softmax and p @ V: kernels of a few microseconds each, whose launches and
gaps in the CUDA graph cost as much as their work, and q @ K^T reads every slot, live or not.
Here, after the step has written the token's roped key and value into the cache:

    split kernel    grid (kv heads, cache blocks of BLOCK_S slots). Every program ropes its G query
                    heads (in fp32, rounded to the cache dtype as HF rounds them), scores the slots
                    of its block up to the token's own (blocks past it load nothing) and writes an
                    unnormalised partial: max, sum of exp, p @ V.
    combine kernel  grid (query heads): rescales the partials by their maxima and sums them
                    (flash-decoding's split-K softmax).

The cache write stays in the compiled step (an index_put inductor performs in place): a
`triton_op` that mutated the caches would be functionalized, and inductor then copied both
caches of every layer around it (+0.28 ms per step on Llama-3.1-8B shapes, H200). The token's
slot is read on the device (the step's staging buffer), so the step stays one CUDA graph.
Registered with `torch.library.triton_op` like gemv.py's kernels; under Triton's interpreter they
run on CPU tensors (tests/test_triton_kernels.py).
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
    def _split_kernel(QKV, COS, SIN, KC, VC, SLOT, PO, PM, PL, S, NSPLIT, scale,
                      HD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_S: tl.constexpr):
        HALF: tl.constexpr = HD // 2
        h = tl.program_id(0)
        sp = tl.program_id(1)
        slot = tl.load(SLOT)
        d = tl.arange(0, HALF)
        # rope(q) = q * cos + rotate_half(q) * sin, rotate_half(q) = [-q2, q1], on halves
        c1 = tl.load(COS + d).to(tl.float32)
        c2 = tl.load(COS + HALF + d).to(tl.float32)
        s1 = tl.load(SIN + d).to(tl.float32)
        s2 = tl.load(SIN + HALF + d).to(tl.float32)
        gi = tl.arange(0, GP)
        live = gi < G
        head = h * G + gi
        qp = QKV + head[:, None] * HD + d[None, :]
        qa = tl.load(qp, mask=live[:, None], other=0.0).to(tl.float32)
        qb = tl.load(qp + HALF, mask=live[:, None], other=0.0).to(tl.float32)
        ra = qa * c1[None, :] - qb * s1[None, :]
        rb = qb * c2[None, :] + qa * s2[None, :]
        qa = ra.to(KC.dtype.element_ty).to(tl.float32)
        qb = rb.to(KC.dtype.element_ty).to(tl.float32)
        # This block's slots up to the token's own.
        j = sp * BLOCK_S + tl.arange(0, BLOCK_S)
        valid = j <= slot
        rows = h * S * HD + j[:, None] * HD + d[None, :]
        ka = tl.load(KC + rows, mask=valid[:, None], other=0.0).to(tl.float32)
        kb = tl.load(KC + rows + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
        sc = tl.sum(qa[:, None, :] * ka[None, :, :], axis=2) + tl.sum(qb[:, None, :] * kb[None, :, :], axis=2)
        sc = tl.where(valid[None, :], sc * scale, float("-inf"))  # shape: [GP, BLOCK_S]
        m = tl.max(sc, axis=1)
        shift = tl.where(m == float("-inf"), 0.0, m)  # a block past the token: every p is exp(-inf) = 0
        p = tl.exp(sc - shift[:, None])
        va = tl.load(VC + rows, mask=valid[:, None], other=0.0).to(tl.float32)
        vb = tl.load(VC + rows + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
        out = PO + (head[:, None] * NSPLIT + sp) * HD + d[None, :]
        tl.store(out, tl.sum(p[:, :, None] * va[None, :, :], axis=1), mask=live[:, None])
        tl.store(out + HALF, tl.sum(p[:, :, None] * vb[None, :, :], axis=1), mask=live[:, None])
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
    def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
                         vc: torch.Tensor, slot: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
        """Attention of one token over the cache: qkv = [q | k | v] of the token before rope
        ([1, (heads + 2 kv) hd]; q is read), cos/sin its rope rows ([1, hd]), kc/vc the caches
        [kv, S, hd] holding slots <= slot[0], the token's own included. Returns [1, heads * hd]."""
        nkv, S, hd = kc.shape
        g = heads // nkv
        nsplit = triton.cdiv(S, BLOCK_S)
        po = torch.empty(heads, nsplit, hd, device=qkv.device, dtype=torch.float32)
        pm = torch.empty(heads, nsplit, device=qkv.device, dtype=torch.float32)
        pl = torch.empty_like(pm)
        out = torch.empty(1, heads * hd, device=qkv.device, dtype=qkv.dtype)
        wrap_triton(_split_kernel)[(nkv, nsplit)](
            qkv, cos, sin, kc, vc, slot, po, pm, pl, S, nsplit, scale,
            HD=hd, G=g, GP=triton.next_power_of_2(g), BLOCK_S=BLOCK_S, num_warps=4)
        wrap_triton(_combine_kernel)[(heads,)](
            po, pm, pl, out, nsplit, HD=hd, SP=triton.next_power_of_2(nsplit), CHUNK=COMBINE_CHUNK, num_warps=4)
        return out


def fits(qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> bool:
    """Whether the kernels apply: one bf16/fp16 token where Triton runs, a head size whose half is a
    power of two (Triton's ranges), contiguous caches of the token's dtype. Shapes, dtypes and
    devices only, so under torch.compile it resolves while tracing."""
    half = kc.shape[-1] // 2
    return (runs_on(qkv) and qkv.shape[0] == 1 and qkv.dtype in (torch.bfloat16, torch.float16)
            and qkv.is_contiguous() and kc.dtype == vc.dtype == qkv.dtype
            and kc.is_contiguous() and vc.is_contiguous() and half >= 1 and half & (half - 1) == 0)
