"""The target's layer math for the static decoder (`static_decoder.py`) and the batch decoder
(`batch.py`): which architectures compute exactly what Hugging Face computes, their shapes, the
compiled functions that run any decoder layer, the step's preparation and its head, the fused
weights they read, and the rope tables.

Weights are fused, not copied: q/k/v and gate/up become single matrices and the HF modules are
re-pointed at views of them, so the HF model keeps working on the same memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..errors import SpecdecError
from ..models.cpu_products import few_row_linear
from .gemv import add_linear as kernel_add_linear
from .gemv import folds_glu, fused_one_token, gemv_linear, pack, pack_layout, rms_glu_linear
from .gemv import norm_linear as kernel_norm_linear
from .config import KernelConfig
from .layer_math import rms_norm, rotate_half
from . import decode_attention

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
STATIC_ROPE_TYPES = ("default", "llama3", "linear", "yarn")


def check_supported(config, max_len: int | None = None) -> None:
    """Raise SpecdecError unless the fast decoder computes exactly what HF computes for `config`."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_ARCHS:
        raise SpecdecError(
            f"the fast path supports {', '.join(SUPPORTED_ARCHS)} targets, found {mt!r}; "
            f"use the reference engine (specdec.engine.engine.SpeculativeEngine)"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise SpecdecError(f"the fast path expects a SiLU MLP, found hidden_act={act!r}; use the reference engine")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rtype = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rtype not in STATIC_ROPE_TYPES:
        raise SpecdecError(
            f"the fast path precomputes rope tables; rope_type {rtype!r} depends on the sequence "
            f"length; expected one of {STATIC_ROPE_TYPES}; use the reference engine"
        )
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    sliding = window is not None and (mt == "mistral" or "sliding_attention" in layer_types)
    if sliding and max_len is not None and window < max_len:
        raise SpecdecError(
            f"the target uses sliding-window attention ({window} tokens) and the fast path attends "
            f"to the whole cache; pass max_len <= {window} or use the reference engine"
        )


@dataclass(frozen=True, kw_only=True)
class Shapes:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @classmethod
    def from_config(cls, c) -> "Shapes":
        heads = c.num_attention_heads
        return cls(
            num_layers=c.num_hidden_layers,
            hidden=c.hidden_size,
            heads=heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            intermediate=c.intermediate_size,
            vocab=c.vocab_size,
            eps=float(c.rms_norm_eps),
        )


def split_heads(qkv: torch.Tensor, s: Shapes, qn, kn):
    """A fused q/k/v row block [..., T, (nh + 2 nkv) hd] -> q [..., T, nh, hd], k and v
    [..., T, nkv, hd], with Qwen3's per-head RMSNorm of q and k before rope."""
    hd = s.head_dim
    q, k, v = qkv.split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd], dim=-1)
    lead = qkv.shape[:-1]
    q, k, v = q.view(*lead, s.heads, hd), k.view(*lead, s.kv_heads, hd), v.view(*lead, s.kv_heads, hd)
    if qn is not None:
        q, k = rms_norm(q, qn, s.eps), rms_norm(k, kn, s.eps)
    return q, k, v


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF's convention; cos/sin broadcast over the heads."""
    return t * cos + rotate_half(t) * sin


def decoder_layer(x, weights, attention, norm_linear, add_linear, glu=None):
    """The target's decoder layer, written once for the static decoder and the batch decoder:
    x + o_proj(attention(qkv_proj(rmsnorm(x)))), then + down(silu(gate) * up) of the normed result.
    `weights` = (ln1, wqkv, bqkv, qn, kn, wo, bo, ln2, wgu, bgu, wd, bd) as `layer_weights` fuses
    them; callers differ in `attention(qkv, qn, kn)` (the cache and the mask), in the products
    (`norm_linear(x, ln, w, b)`, `add_linear(residual, x, w, b)`: plain, or Triton kernels with the
    norm and the residual add folded in) and in `glu(x, ln2, wgu, bgu)`, a folded SiLU * up or None."""
    ln1, wqkv, bqkv, qn, kn, wo, bo, ln2, wgu, bgu, wd, bd = weights
    x = add_linear(x, attention(norm_linear(x, ln1, wqkv, bqkv), qn, kn), wo, bo)
    act = glu(x, ln2, wgu, bgu) if glu is not None else None
    if act is None:
        gate, up = norm_linear(x, ln2, wgu, bgu).chunk(2, dim=-1)
        act = F.silu(gate) * up
    return add_linear(x, act, wd, bd)


def make_layer_fn(s: Shapes, gemv: bool = False, attention_kernel: bool | None = None,
                  kernels: KernelConfig = KernelConfig()):
    """One decoder layer over T tokens. Every argument is a tensor (or None), so one compiled
    graph serves all layers. With `gemv`, steps of up to kernels.rows_max tokens run gemv.py's
    Triton products (the GEMV for one token, the rows kernel for a verify step), each RMSNorm and
    residual add folded into its product and, for small MLPs at one token, SiLU * up into the
    gate/up product's store; with `attention_kernel` (default: as `gemv`), the attention of a step
    of few tokens runs as decode_attention.py's kernels."""
    kernel = gemv if attention_kernel is None else attention_kernel
    nh, nkv, hd, g, eps = s.heads, s.kv_heads, s.head_dim, s.groups, s.eps
    scale = hd**-0.5

    def linear(x, w, b):
        return gemv_linear(x, w, b, kernels) if gemv else few_row_linear(x, w, b)

    def norm_linear(x, ln, w, b):
        if not gemv:
            return few_row_linear(rms_norm(x, ln, eps), w, b)
        y = kernel_norm_linear(x, ln, eps, w, kernels)
        return y if b is None else y + b

    def add_linear(residual, x, w, b):
        if gemv and b is None:
            return kernel_add_linear(residual, x, w, kernels)
        return residual + linear(x, w, b)

    def attention(qkv, qn, kn, kv, cos, sin, slots, mask, tm):
        T = qkv.shape[0]
        q, k, v = split_heads(qkv, s, qn, kn)  # shapes: [T, nh, hd], [T, nkv, hd] x2
        c, sn = cos[:, None, :], sin[:, None, :]
        k = rope(k, c, sn)
        # kv shape: [2, nkv, S, hd]; one index_put_ for keys and values, reinplaced
        kv[:, :, slots] = torch.stack((k, v)).transpose(1, 2)
        if kernel and qn is None and decode_attention.fits(qkv, kv, nh, kernels):
            block, chunk = decode_attention.settings(kernels, T)  # the op ropes q itself:
            return decode_attention.decode_attention(qkv, cos, sin, kv, slots, tm, nh, scale, block, chunk)
        q = rope(q, c, sn)
        # GQA without repeating the cache: the g query heads of one kv head become g*T rows.
        qg = q.view(T, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * T, hd)
        att = torch.matmul(qg, kv[0].transpose(1, 2)) * scale  # shape: [nkv, gT, S]
        att = att + mask
        att = torch.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(att, kv[1])  # shape: [nkv, gT, hd]
        return o.view(nkv, g, T, hd).permute(2, 0, 1, 3).reshape(T, nh * hd)

    def glu(x, ln2, wgu, bgu):
        if gemv and bgu is None and fused_one_token(x, wgu) and folds_glu(wgu, kernels):
            return rms_glu_linear(x, ln2, eps, wgu)
        return None

    def layer(x, ln1, wqkv, bqkv, qn, kn, wo, bo, ln2, wgu, bgu, wd, bd, kv, cos, sin, slots, mask, tm):
        return decoder_layer(x, (ln1, wqkv, bqkv, qn, kn, wo, bo, ln2, wgu, bgu, wd, bd),
                             lambda qkv, qn, kn: attention(qkv, qn, kn, kv, cos, sin, slots, mask, tm),
                             norm_linear, add_linear, glu)

    return layer


def make_prep_fn(s: Shapes, cache_len: int):
    """Unpack the staging buffer: embeddings, rope rows, cache slots, the additive mask [gT, S] (for
    the compiled attention) and the tree mask [T, T] (for decode_attention's kernels)."""
    g = s.groups

    def prep(staging, embed, cos_t, sin_t):
        T = math.isqrt(staging.shape[0]) - 1  # len = 1 + 2T + T^2 = (T + 1)^2
        slot0 = staging[0:1]
        ids, pos = staging[1 : 1 + T], staging[1 + T : 1 + 2 * T]
        tm = staging[1 + 2 * T :].view(T, T) != 0
        x = F.embedding(ids, embed)
        cos, sin = cos_t[pos], sin_t[pos]
        rel = torch.arange(cache_len, device=staging.device) - slot0  # shape: [S]
        in_step = (rel >= 0) & (rel < T) & tm[:, rel.clamp(0, T - 1)]
        allowed = (rel < 0) | in_step  # shape: [T, S]
        mask = torch.zeros(T, cache_len, dtype=embed.dtype, device=staging.device)
        mask = mask.masked_fill(~allowed, torch.finfo(embed.dtype).min).repeat(g, 1)  # [gT, S]
        slots = slot0 + torch.arange(T, device=staging.device)
        return x, cos, sin, slots, mask, staging[1 + 2 * T :].view(T, T)

    return prep


def split_argmax(logits: torch.Tensor, chunks: int = 64) -> torch.Tensor:
    """`logits.argmax(-1)` in two reductions: inductor reduces a row in one program, slow for a
    128K-token vocabulary (benchmarks/profile_8b.py); `chunks` programs per row, then one over
    their maxima. Ties go to the first index, as with argmax (max over a dim returns the first)."""
    T, V = logits.shape
    n = -(-V // chunks)
    padded = F.pad(logits, (0, n * chunks - V), value=float("-inf"))
    vals, idx = padded.view(T, chunks, n).max(dim=-1)
    best = vals.argmax(dim=-1, keepdim=True)
    return (best * n + idx.gather(-1, best)).squeeze(-1)


def make_head_fn(s: Shapes, gemv: bool = False, kernels: KernelConfig = KernelConfig()):
    eps = s.eps

    def head(x, norm_w, lm_w):
        if gemv:
            logits = kernel_norm_linear(x, norm_w, eps, lm_w, kernels)  # shape: [T, V]
        else:
            logits = few_row_linear(rms_norm(x, norm_w, eps), lm_w)
        return logits, split_argmax(logits) if gemv else logits.argmax(dim=-1)

    return head



@dataclass
class _Layer:
    ln1: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    qn: torch.Tensor | None
    kn: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor
    wgu: torch.Tensor
    bgu: torch.Tensor | None
    wd: torch.Tensor
    bd: torch.Tensor | None

    def args(self):
        return (self.ln1, self.wqkv, self.bqkv, self.qn, self.kn, self.wo, self.bo, self.ln2,
                self.wgu, self.bgu, self.wd, self.bd)

    def packed(self, min_bytes: int) -> "_Layer":
        """This layer with its products' weights of at least `min_bytes` packed where
        gemv.pack_layout says so (new tensors)."""
        def packed(w):
            layout = pack_layout(*w.shape, w.numel() * w.element_size(), min_bytes)
            return w if layout is None else pack(w, layout)
        return replace(self, wqkv=packed(self.wqkv), wo=packed(self.wo), wgu=packed(self.wgu),
                                   wd=packed(self.wd))


def _fuse(mods, share: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of nn.Linear modules along the output dimension;
    with `share`, point each module at its view of the fused tensor (no second copy)."""
    w = torch.cat([m.weight.data for m in mods], dim=0)
    has_b = [m.bias is not None for m in mods]
    if any(has_b) and not all(has_b):
        raise SpecdecError("fused projections must all have biases or none")
    b = torch.cat([m.bias.data for m in mods], dim=0) if all(has_b) else None
    if share:
        off = 0
        for m in mods:
            n = m.weight.shape[0]
            m.weight.data = w[off : off + n]
            if b is not None:
                m.bias.data = b[off : off + n]
            off += n
    return w, b


def _bias(m) -> torch.Tensor | None:
    return m.bias.data if getattr(m, "bias", None) is not None else None


def layer_weights(model, share: bool = True) -> list[_Layer]:
    """Every decoder layer's weights with q/k/v and gate/up fused (`_fuse`); with `share` the HF
    modules are re-pointed at views of the fused tensors, so no memory is duplicated."""
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        wqkv, bqkv = _fuse([a.q_proj, a.k_proj, a.v_proj], share)
        wgu, bgu = _fuse([m.gate_proj, m.up_proj], share)
        qn = getattr(a, "q_norm", None)
        kn = getattr(a, "k_norm", None)
        layers.append(_Layer(
            ln1=layer.input_layernorm.weight.data, wqkv=wqkv, bqkv=bqkv,
            qn=qn.weight.data if qn is not None else None,
            kn=kn.weight.data if kn is not None else None,
            wo=a.o_proj.weight.data, bo=_bias(a.o_proj),
            ln2=layer.post_attention_layernorm.weight.data,
            wgu=wgu, bgu=bgu, wd=m.down_proj.weight.data, bd=_bias(m.down_proj),
        ))
    return layers


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def rope_tables(model, n: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, head_dim] from a fresh copy of the model's own rotary module (its buffers may
    be uninitialised after a meta-device build), computed on CPU in fp32 then cast like HF."""
    rot = model.model.rotary_emb
    fresh = type(rot)(config=model.config)
    pos = torch.arange(n)[None]
    cos, sin = fresh(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0].to(device=device, dtype=dtype), sin[0].to(device=device, dtype=dtype)
