"""Token distributions and the lossless acceptance rule shared by chain and tree verification.

Recursive rejection sampling without replacement: the children of a tree node were drawn from
the drafter's distribution q without replacement (Gumbel top-k); child i is accepted with
probability min(1, p(c)/q_i(c)), where q_i is q with the earlier children removed; on rejection
the target distribution becomes norm(max(p - q_i, 0)). A chain is the one-child case, n-gram
drafts the one-hot case. The output distribution is exactly the target's.
"""

from __future__ import annotations

import torch

from .api import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-p nucleus. shape: [..., V] float32."""
    probs = torch.softmax(logits.float() / max(params.temperature, 1e-5), dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < params.top_p
        keep[..., 0] = True  # the most likely token always stays, also where top_p rounds to 0
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=gen).item())


def gumbel_topk(log_q: torch.Tensor, k: int, gen: torch.Generator | None) -> torch.Tensor:
    """k draws without replacement from softmax(log_q), in draw order. shape: [..., k]."""
    u = torch.rand(log_q.shape, generator=gen, device=log_q.device).clamp_(1e-20, 1.0)
    return (log_q - torch.log(-torch.log(u))).topk(k, dim=-1).indices


def accept_among_children(
    p: torch.Tensor,
    children_tokens: list[int],
    q: torch.Tensor | None,
    gen: torch.Generator | None,
) -> tuple[int | None, torch.Tensor]:
    """Try children in draw order. Returns (index of the accepted child or None, residual p).

    `q` is the drafter's full distribution at this node over the target vocab, or None when the
    draft was deterministic (one-hot, as for n-gram lookup).
    """
    q_rem = None if q is None else q.clone()
    for i, tok in enumerate(children_tokens):
        if q_rem is None:
            qi = torch.zeros_like(p)
            qi[tok] = 1.0
        else:
            total = q_rem.sum()
            qi = q_rem / total if total > 0 else torch.zeros_like(p)
        qt = float(qi[tok])
        ratio = 1.0 if qt <= 0 else min(1.0, float(p[tok]) / qt)
        if qt > 0 and torch.rand((), generator=gen, device=p.device).item() < ratio:
            return i, p
        residual = (p - qi).clamp_(min=0.0)
        s = residual.sum()
        p = residual / s if s > 0 else p
        if q_rem is not None:
            q_rem[tok] = 0.0
    return None, p
