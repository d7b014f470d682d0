"""Draft trees: node tokens, parents and depths, with the attention masks that let one target
forward pass verify every branch. A chain is a tree whose node i has parent i-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(kw_only=True)
class TreeConfig:
    depth: int = 6
    top_k: int = 8
    total_tokens: int = 48


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = child of the last committed token
    # Drafter distribution (target vocab) from which each parent's children were drawn; key -1 =
    # the root. None everywhere for deterministic drafts (greedy or n-gram).
    q: dict[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        d = []
        for p in self.parents:
            d.append(0 if p < 0 else d[p] + 1)
        return d

    def children(self) -> dict[int, list[int]]:
        ch: dict[int, list[int]] = {-1: []}
        for i, p in enumerate(self.parents):
            ch.setdefault(p, []).append(i)
        return ch


def ancestor_mask(parents: list[int], device=None) -> torch.Tensor:
    """bool [N, N]: node i may attend to node j (j is i or one of its ancestors)."""
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] |= m[p]
    return m.to(device) if device is not None else m


def verify_mask(parents: list[int], prefix_len: int, dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, 1 + N, prefix_len + 1 + N] for [last token, *tree nodes]."""
    n = len(parents)
    allowed = torch.zeros(1 + n, prefix_len + 1 + n, dtype=torch.bool)
    allowed[:, : prefix_len + 1] = True
    allowed[1:, prefix_len + 1 :] = ancestor_mask(parents)
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)
