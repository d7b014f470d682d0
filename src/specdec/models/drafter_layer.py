"""The EAGLE-3 drafter's one decoder layer, written once for its two forms:

  the modules   `Eagle3Drafter.layer` (training's TTT, inference, the static drafter's compiled steps):
                separate nn.Linear products, rope applied to q and k after the q/k/v product;
  the kernels   `engine/eagle_kernels.KernelLayer` (greedy chains on a GPU): fused q/k/v and gate/up
                matrices on Triton kernels, each RMSNorm or residual add folded into its product where
                the kernels take it, keys roped into the cache and q roped by decode_attention itself.

`drafter_layer` is the recipe; a form supplies its products as a `DrafterLayerOps` and its attention
(which cache it reads and where rope happens) per call, as the target's `static_layers.decoder_layer`
takes its own. A change to the layer's steps is made here, once, and both forms run it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DrafterLayerOps:
    """How one form computes each step of the drafter's layer. Tensors keep the caller's leading
    dimensions ([B, T] for the modules, [T] for the kernels); the last one is the features."""

    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids -> embeddings [.., H]
    input_layernorm: Callable[[torch.Tensor], torch.Tensor]  # RMSNorm of the embeddings
    hidden_norm: Callable[[torch.Tensor], torch.Tensor]  # RMSNorm of the hidden state
    # x [.., 2H] -> the q/k/v product, in whatever form the caller's attention reads (the modules'
    # (q, k, v) already roped; the kernels' one fused row block, roped in the attention)
    qkv_proj: Callable[[torch.Tensor], Any]
    o_proj_add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (residual, o) -> residual + o_proj(o)
    # h -> (gate, up) of post_attention_layernorm(h): the norm folded into the product on the kernels
    gate_up: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    down_add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (residual, act) -> residual + down(act)
    # h -> act(gate) * up of post_attention_layernorm(h) in one product (the kernels' folded GLU for
    # one token and a small MLP), or None where it does not fold this input; None: never folds
    glu: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu  # the modules pass their MLP's (config.hidden_act)


def drafter_layer(ids: torch.Tensor, hidden: torch.Tensor, ops: DrafterLayerOps,
                  attention: Callable[[Any], torch.Tensor], *, norm_before_residual: bool) -> torch.Tensor:
    """The drafter's decoder layer over ids [..] and hidden [.., H] (fc's output or a recycled hidden):

        x = [input_layernorm(embed(ids)) | hidden_norm(hidden)]          2H wide: the token and the state
        h = residual + o_proj(attention(qkv_proj(x)))                    residual: hidden, or hidden_norm(hidden)
        h + down(act(gate) * up)                                         gate, up: of post_attention_layernorm(h)

    `attention(qkv)` -> [.., nh * hd] ropes what `ops.qkv_proj` left un-roped, writes its keys and
    values where the caller keeps them and attends. Returns the layer's output [.., H], before the
    final norm."""
    normed = ops.hidden_norm(hidden)
    # norm_before_residual (speculators' default): the residual stream starts from the normed state
    residual = normed if norm_before_residual else hidden
    # Under autocast the frozen fp32 embedding meets fc's bf16 output; a no-op where the dtypes agree.
    x = torch.cat([ops.input_layernorm(ops.embed(ids).to(hidden.dtype)), normed], dim=-1)
    h = ops.o_proj_add(residual, attention(ops.qkv_proj(x)))
    act = ops.glu(h) if ops.glu is not None else None
    if act is None:
        gate, up = ops.gate_up(h)
        act = ops.act(gate) * up
    return ops.down_add(h, act)
