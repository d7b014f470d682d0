"""The elementwise math of a decoder layer that the target's fast decoder (fast.py) and the
drafter's kernel layer (eagle_kernels.py) both run, written once so the two round alike."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Exactly HF's LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rope's half rotation, HF's convention (the two halves of the head, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
