"""The EAGLE-3 drafter's layer on the fast path's Triton kernels, for greedy chains on a GPU.

Compiled by inductor and captured in a CUDA graph, the drafter's layer still runs its products as
cuBLAS GEMMs of one row and its attention over the whole preallocated cache under a mask; a round of
a SmolLM2-sized drafter is much faster on these kernels (benchmarks/drafter_step.py).
Here the layer is the drafter's one recipe (models/drafter_layer.py, which the modules run too) on
fused weights, in the target's fast-path style (engine/fast.py):

    x = [input_layernorm(embed(token)) | hidden_norm(hidden)]        2H wide, the q/k/v product's input
    q/k/v in one product, keys roped into the cache, decode_attention over the live slots only
    o_proj with the residual add at its store, the MLP's gate/up with RMSNorm and SiLU * up
    folded in, down with the residual add, then the final norm folded into the lm_head product.

A step's T rows occupy the contiguous slots pos[0]..pos[0] + T - 1 and see every slot before them
(the chain's commit and its drafts); trees keep the compiled layer. Same weights as the drafter's
modules, fused once (q/k/v and gate/up concatenated), so a drafter loaded later is not seen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.drafter import Eagle3Drafter
from ..models.drafter_layer import DrafterLayerOps, drafter_layer
from . import decode_attention, gemv
from .config import KernelConfig
from .layer_math import rms_norm, rotate_half


def applies(drafter: Eagle3Drafter, rows: int, kernels: KernelConfig) -> bool:
    """Whether the kernels can take this drafter for steps of up to `rows` tokens: a bf16/fp16
    drafter where Triton runs (gemv.runs_on), a head size and query rows decode_attention takes, the plain fc
    (the gpt-oss-style norms before fc stay on the compiled layer), and a SiLU MLP (the gate/up
    kernel and the layer's ops below compute SiLU)."""
    cfg = drafter.cfg
    w = drafter.lm_head.weight
    hd, nkv = cfg.head_dim, cfg.num_key_value_heads
    g = cfg.num_attention_heads // nkv
    return (gemv.runs_on(w) and hd >= 16 and hd & (hd - 1) == 0 and g * rows <= kernels.attention_max_rows
            and rows <= kernels.rows_max and drafter.input_norm is None and drafter.fc_norm is None
            and cfg.hidden_act == "silu")


class KernelLayer:
    """The drafter's layer over a chain step; `kv` [2, kv heads, slots, head size] is its cache."""

    def __init__(self, drafter: Eagle3Drafter, kv: torch.Tensor, kernels: KernelConfig):
        d, cfg = drafter, drafter.cfg
        self.kernels = kernels
        m, a = d.midlayer, d.midlayer.self_attn
        with torch.no_grad():
            self.embed = d.embed_tokens.weight
            self.fc = d.fc.weight
            self.ln_in, self.ln_hidden = m.input_layernorm.weight, m.hidden_norm.weight
            self.wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous()
            self.wo = a.o_proj.weight
            self.ln2 = m.post_attention_layernorm.weight
            self.wgu = torch.cat([m.mlp.gate_proj.weight, m.mlp.up_proj.weight]).contiguous()
            self.wd = m.mlp.down_proj.weight
            self.norm_w, self.lm_w = d.norm.weight, d.lm_head.weight
            # Rope rows for every slot, as the drafter's rotary embedding computes them.
            slots = torch.arange(kv.shape[2], device=kv.device)
            cos, sin = d.rotary_emb(self.lm_w, slots[None])
            self.cos, self.sin = cos[0].to(kv.dtype), sin[0].to(kv.dtype)
        self.kv = kv
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.norm_before_residual, self.norm_output = cfg.norm_before_residual, cfg.norm_output
        self.ops = _ops(self, kernels)

    def _attention(self, qkv, pos, tm):
        """Keys roped into the cache slots `pos`, values beside them; decode_attention ropes q itself
        and attends over the live slots. qkv [T, (nh + 2 nkv) hd] -> [T, nh hd]."""
        T = qkv.shape[0]
        nh, nkv, hd = self.heads, self.kv_heads, self.head_dim
        _, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        cos, sin = self.cos[pos], self.sin[pos]
        k = k.view(T, nkv, hd)
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        self.kv[:, :, pos] = torch.stack((k, v.view(T, nkv, hd))).transpose(1, 2)
        block, chunk = decode_attention.settings(self.kernels, T)
        return decode_attention.decode_attention(qkv, cos, sin, self.kv, pos, tm, nh, hd**-0.5, block, chunk)

    def __call__(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, tm: torch.Tensor,
                 aux: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [1, T], hidden [1, T, 3tH] (aux: the target's states) or [1, T, H] (recycled), pos [T]
        positions = cache slots, tm [T, T] the causal mask as ints. Returns (hidden [1, T, H],
        logits [1, T, draft vocab]), as `Eagle3Drafter.head` does."""
        h = hidden[0]
        if aux:
            h = gemv.gemv_linear(h, self.fc, None, self.kernels)
        h = drafter_layer(ids[0], h, self.ops, lambda qkv: self._attention(qkv, pos, tm),
                          norm_before_residual=self.norm_before_residual)
        logits = gemv.norm_linear(h, self.norm_w, self.eps, self.lm_w, self.kernels)
        out = rms_norm(h, self.norm_w, self.eps) if self.norm_output else h
        return out[None], logits[None]


def _ops(k: KernelLayer, kernels: KernelConfig) -> DrafterLayerOps:
    """The layer's products on `k`'s fused weights (drafter_layer.py has the recipe), each norm or
    residual add folded into its product where the kernels take it. Built once, not per step; the
    closures hold the weights, not the layer (no reference cycle keeping its cache alive)."""
    embed, ln_in, ln_hidden, eps = k.embed, k.ln_in, k.ln_hidden, k.eps
    wqkv, wo, ln2, wgu, wd = k.wqkv, k.wo, k.ln2, k.wgu, k.wd

    def glu(h):  # SiLU(gate) * up in the gate/up product's store: one token, a small MLP
        if gemv.fused_one_token(h, wgu) and gemv.folds_glu(wgu, kernels):
            return gemv.rms_glu_linear(h, ln2, eps, wgu)
        return None

    return DrafterLayerOps(
        embed=lambda ids: F.embedding(ids, embed),
        input_layernorm=lambda e: rms_norm(e, ln_in, eps),
        hidden_norm=lambda h: rms_norm(h, ln_hidden, eps),
        qkv_proj=lambda x: gemv.gemv_linear(x, wqkv, None, kernels),  # shape: [T, (nh + 2 nkv) hd]
        o_proj_add=lambda residual, o: gemv.add_linear(residual, o, wo, kernels),
        gate_up=lambda h: gemv.norm_linear(h, ln2, eps, wgu, kernels).chunk(2, dim=-1),
        down_add=lambda residual, act: gemv.add_linear(residual, act, wd, kernels),
        glu=glu,
    )
