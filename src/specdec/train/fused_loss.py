"""The TTT loss's soft cross-entropy as one Triton kernel each way (`train --fused-loss`, CUDA).

Each TTT step scores the draft logits [B, n, Vd] against the target's distribution over the draft
vocab, -sum(p * log_softmax(x)). Written as PyTorch ops (`ttt.soft_cross_entropy`), that is a
cast to fp32, the log-softmax, a product and a sum going forward and as many passes back, every one
over a logits-sized tensor: about 60 bytes of memory traffic per logit per step. With the
log-sum-exp of a row, lse, the loss of the row is lse * sum(p) - sum(p * x) and its gradient
(softmax(x) * sum(p) - p) times the row's incoming gradient. So one kernel reads a row's logits
and p once (an online max and sum of exponentials) and keeps three floats, and one kernel reads
them again and writes the gradient: about 14 bytes per logit, in two launches.

The rows are read through their strides, so the shifted views the TTT unroll passes (the logits'
first n positions, p from position 1 + s) are never copied. Triton's interpreter runs the same
kernels on CPU tensors (tests/test_fused_loss.py).
"""

from __future__ import annotations

import torch

from ..engine.gemv import INTERPRETED, triton
from .ttt import weighted_mean

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _forward_kernel(X, P, CE, LSE, PSUM, n, V, sxb, sxt, spb, spt, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # a batch's logits may pass 2**31 elements
        b, t = row // n, row % n
        x_row, p_row = X + b * sxb + t * sxt, P + b * spb + t * spt
        # Per lane: running max, sum of exponentials below it, sum of p * x and of p. Masked lanes
        # hold a finite floor, never -inf, so no lane ever computes inf - inf.
        mv = tl.full([BLOCK_V], -1e30, tl.float32)
        sv = tl.zeros([BLOCK_V], tl.float32)
        dot = tl.zeros([BLOCK_V], tl.float32)
        ps = tl.zeros([BLOCK_V], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            keep = cols < V
            x = tl.load(x_row + cols, mask=keep, other=-1e30).to(tl.float32)
            p = tl.load(p_row + cols, mask=keep, other=0.0).to(tl.float32)
            m_new = tl.maximum(mv, x)
            sv = sv * tl.exp(mv - m_new) + tl.where(keep, tl.exp(x - m_new), 0.0)
            mv = m_new
            dot += tl.where(keep, p * x, 0.0)
            ps += p
        m = tl.max(mv, axis=0)
        lse = m + tl.log(tl.sum(sv * tl.exp(mv - m), axis=0))
        psum = tl.sum(ps, axis=0)
        tl.store(CE + row, lse * psum - tl.sum(dot, axis=0))
        tl.store(LSE + row, lse)
        tl.store(PSUM + row, psum)

    @triton.jit
    def _backward_kernel(X, P, LSE, PSUM, G, DX, n, V, sxb, sxt, spb, spt, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        b, t = row // n, row % n
        x_row, p_row, dx_row = X + b * sxb + t * sxt, P + b * spb + t * spt, DX + row * V
        lse, psum, g = tl.load(LSE + row), tl.load(PSUM + row), tl.load(G + row)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            keep = cols < V
            x = tl.load(x_row + cols, mask=keep, other=0.0).to(tl.float32)
            p = tl.load(p_row + cols, mask=keep, other=0.0).to(tl.float32)
            dx = (tl.exp(x - lse) * psum - p) * g
            tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=keep)


def available(device: torch.device | str) -> bool:
    """Whether the kernels run on `device`: CUDA with Triton, or any device under its interpreter."""
    return triton is not None and (torch.device(device).type == "cuda" or INTERPRETED)


def _block(V: int) -> int:
    return min(2048, triton.next_power_of_2(V))


class _SoftCrossEntropy(torch.autograd.Function):
    """Per row of logits x [B, n, V] and p [B, n, V] (any row strides, unit stride along V):
    lse(x) * sum(p) - sum(p * x) as fp32 [B, n]."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        if p.stride(-1) != 1:
            p = p.contiguous()
        B, n, V = logits.shape
        ce, lse, psum = (torch.empty(B, n, dtype=torch.float32, device=logits.device) for _ in range(3))
        grid = (B * n,)
        _forward_kernel[grid](logits, p, ce, lse, psum, n, V, logits.stride(0), logits.stride(1), p.stride(0),
                              p.stride(1), BLOCK_V=_block(V), num_warps=8)
        ctx.save_for_backward(logits, p, lse, psum)
        return ce

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, p, lse, psum = ctx.saved_tensors
        B, n, V = logits.shape
        dx = torch.empty(B, n, V, dtype=logits.dtype, device=logits.device)
        _backward_kernel[(B * n,)](logits, p, lse, psum, grad.float().contiguous(), dx, n, V, logits.stride(0),
                                   logits.stride(1), p.stride(0), p.stride(1), BLOCK_V=_block(V), num_warps=8)
        return dx, None


def fused_soft_cross_entropy(logits: torch.Tensor, p_target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`ttt.soft_cross_entropy` with the per-row work in the kernels above: the mean over the
    weighted positions of -sum(p_target * log_softmax(logits)); logits and p_target [B, n, Vd],
    weight [B, n]."""
    return weighted_mean(_SoftCrossEntropy.apply(logits, p_target), weight)
