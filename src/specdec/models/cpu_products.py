"""fp32 linear layers over a few rows on a CPU, computed as `weight @ x.T`.

Decoding feeds a linear layer 1 row, verifying k drafts k + 1 rows. For these shapes PyTorch's
fp32 `F.linear` on CPU takes a path that streams the weight at about half the memory bandwidth
that a plain `weight @ x.T` product reaches, and it gets slower per row from 2 rows on. On a
2-core AMD EPYC (torch 2.13; benchmarks/cpu_linear_rows.py), Qwen2.5-1.5B's [151,936 x 1,536]
lm_head costs 74.7 ms for one row and 150.3 ms for two with `F.linear`, 63.0 ms (one row, padded
to two) and 65.8 ms (two rows) as `weight @ x.T`; the whole target's forward over 1 and 2 tokens
drops from 538 and 995 ms to 454 and 628 ms (benchmarks/cpu_verify_cost.py). Without this, every
speculative method loses on such a CPU in fp32, since verifying 2 tokens costs twice one.

bf16 and GPUs keep `F.linear`: their kernels do not have this cliff.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 8  # measured up to 8 rows; from 12-16 rows on both paths cost about the same
# One row padded to two only for wide outputs (the lm_head, 4x+ more outputs than inputs): there
# the two-row product costs less than F.linear's one row (SmolLM2's lm_head: 5.1 against 11.9 ms);
# for square and narrow weights it gains nothing or loses.
PAD_ONE_ROW_RATIO = 4


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, computed as `weight @ x.T` for few fp32 rows on a CPU. Every
    test is on shapes, dtype and device, so under torch.compile it resolves while tracing."""
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    out_features, in_features = weight.shape
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        if out_features < PAD_ONE_ROW_RATIO * in_features:
            return F.linear(x, weight, bias)
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    y = (weight @ flat.T).T[:rows].reshape(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


def few_row_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return few_row_linear(x, self.weight, self.bias)


def route_few_row_products(model: nn.Module) -> int:
    """Make every fp32 `nn.Linear` of `model` compute few-row inputs as `weight @ x.T`; returns how
    many layers were routed. Larger inputs, other dtypes and other devices keep `F.linear`."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.float32:
            module.forward = few_row_forward.__get__(module)
            n += 1
    return n


def unroute_few_row_products(model: nn.Module) -> int:
    """Undo `route_few_row_products` (to measure against `F.linear`); returns how many layers."""
    n = 0
    for module in model.modules():
        if getattr(module.forward, "__func__", None) is few_row_forward:
            del module.forward
            n += 1
    return n
