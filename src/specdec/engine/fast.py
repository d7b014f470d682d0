"""The CUDA fast path: a static-KV-cache decoder for Llama-family targets, with every target step
(plain decode of 1 token, verification of k+1 tokens, a prefill chunk) captured as one CUDA graph.

Built from a Hugging Face model's own weights (Llama, Qwen2, Qwen3, Mistral, SmolLM2 share the
math): q/k/v and gate/up are fused into single matrices (the HF modules are re-pointed at views of
them, so no memory is duplicated and the HF model keeps working); one compiled function runs any
decoder layer, one the embedding/rope/mask preparation and one the final norm + lm_head + argmax;
the whole step is then captured with `torch.cuda.CUDAGraph`. A step reads its inputs from one
int64 staging buffer (one host-to-device copy) and the host reads back only the argmax tokens
(the accepted length follows from them), or the logits when sampling. Greedy plain and EAGLE-3
chain steps go further (`FastEngine._device_steps`): the device writes the next step's staging
itself and the host reads each step while the next one runs.

Layout of a step of T tokens (T is a captured bucket; shorter drafts are padded):
    staging = [slot0, ids[T], rope_pos[T], tree_mask[T*T]]
slot0 is the first cache slot written (= tokens already in the cache); row t attends to every
slot < slot0 and to the in-step slots its tree mask allows (lower triangle for a chain). Rope
positions are P + depth, slots are P + index, so trees and chains share one path. Rolling back
is a pointer move; an accepted tree path is compacted with one captured copy.

`FastEngine` subclasses the reference `SpeculativeEngine` and exposes the same `generate_iter`
/ `generate`, `StepOutput` / `GenerationResult`; `make_engine` picks it when it applies and
falls back to the reference engine otherwise.

Examples:
    from specdec.engine.fast import make_engine
    engine = make_engine(load_target("smollm2-135m-instruct"), ngram=3, k=7)
    print(engine.generate(prompt_ids, SamplingParams(max_new_tokens=256)).stats())

    python benchmarks/smollm2.py       # GPU: ms/token against HF eager, same run
"""

from __future__ import annotations

import itertools
import math
import shutil
import time
import warnings
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import SpecdecError
from ..models.cpu_products import few_row_linear
from ..models.target import Target
from .api import SamplingParams, StepOutput
from .eagle import Eagle3Proposer
from .eagle_graph import StaticChainDrafter, StaticTreeDrafter
from .engine import SpeculativeEngine, step_output
from .gemv import (ROWS_MAX, folds, folds_glu, fused_one_token, gemv_linear, linear_add, pack, pack_layout,
                   rms_glu_linear, rms_linear)
from .layer_math import rms_norm, rotate_half
from . import decode_attention
from . import gemv as gemv_kernels
from .sampling import sample, target_probs
from .tree import Draft, TreeConfig, ancestor_mask

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


def make_layer_fn(s: Shapes, gemv: bool = False, attention_kernel: bool | None = None):
    """One decoder layer over T tokens. Every argument is a tensor (or None), so one compiled
    graph serves all layers. With `gemv`, steps of up to gemv.ROWS_MAX tokens run gemv.py's Triton
    products (the GEMV for one token, the rows kernel for a verify step), each RMSNorm and residual add
    folded into its product and, for small MLPs at one token, SiLU * up into the gate/up product's
    store; with `attention_kernel` (default: as `gemv`), the attention of a step of few tokens
    runs as decode_attention.py's kernels."""
    kernel = gemv if attention_kernel is None else attention_kernel
    nh, nkv, hd, g, eps = s.heads, s.kv_heads, s.head_dim, s.groups, s.eps
    scale = hd**-0.5
    linear = gemv_linear if gemv else few_row_linear

    def norm_linear(x, ln, w, b):
        if gemv and folds(x, w):
            y = rms_linear(x, ln, eps, w)
            return y if b is None else y + b
        return linear(rms_norm(x, ln, eps), w, b)

    def add_linear(residual, x, w, b):
        if gemv and b is None and folds(x, w):
            return linear_add(x, w, residual)
        return residual + linear(x, w, b)

    def attention(qkv, qn, kn, kv, cos, sin, slots, mask, tm):
        T = qkv.shape[0]
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k, v = q.view(T, nh, hd), k.view(T, nkv, hd), v.view(T, nkv, hd)
        if qn is not None:  # Qwen3: per-head RMSNorm before rope
            q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
        c, sn = cos[:, None, :], sin[:, None, :]
        k = k * c + rotate_half(k) * sn
        # kv shape: [2, nkv, S, hd]; one index_put_ for keys and values, reinplaced
        kv[:, :, slots] = torch.stack((k, v)).transpose(1, 2)
        if kernel and qn is None and decode_attention.fits(qkv, kv, nh):
            return decode_attention.decode_attention(qkv, cos, sin, kv, slots, tm, nh, scale)  # ropes q itself
        q = q * c + rotate_half(q) * sn
        # GQA without repeating the cache: the g query heads of one kv head become g*T rows.
        qg = q.view(T, nkv, g, hd).permute(1, 2, 0, 3).reshape(nkv, g * T, hd)
        att = torch.matmul(qg, kv[0].transpose(1, 2)) * scale  # shape: [nkv, gT, S]
        att = att + mask
        att = torch.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(att, kv[1])  # shape: [nkv, gT, hd]
        return o.view(nkv, g, T, hd).permute(2, 0, 1, 3).reshape(T, nh * hd)

    def layer(x, ln1, wqkv, bqkv, qn, kn, wo, bo, ln2, wgu, bgu, wd, bd, kv, cos, sin, slots, mask, tm):
        qkv = norm_linear(x, ln1, wqkv, bqkv)  # shape: [T, (nh + 2 nkv) hd]
        x = add_linear(x, attention(qkv, qn, kn, kv, cos, sin, slots, mask, tm), wo, bo)
        if gemv and bgu is None and fused_one_token(x, wgu) and folds_glu(wgu):
            act = rms_glu_linear(x, ln2, eps, wgu)
        else:
            gate, up = norm_linear(x, ln2, wgu, bgu).chunk(2, dim=-1)
            act = F.silu(gate) * up
        return add_linear(x, act, wd, bd)

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
    """`logits.argmax(-1)` in two reductions: inductor reduces a row in one program, 30 us for
    Llama-3's 128K logits on an H200 (profile_8b.py); `chunks` programs per row, then one over
    their maxima. Ties go to the first index, as with argmax (max over a dim returns the first)."""
    T, V = logits.shape
    n = -(-V // chunks)
    padded = F.pad(logits, (0, n * chunks - V), value=float("-inf"))
    vals, idx = padded.view(T, chunks, n).max(dim=-1)
    best = vals.argmax(dim=-1, keepdim=True)
    return (best * n + idx.gather(-1, best)).squeeze(-1)


def make_head_fn(s: Shapes, gemv: bool = False):
    eps = s.eps
    linear = gemv_linear if gemv else few_row_linear

    def head(x, norm_w, lm_w):
        if gemv and folds(x, lm_w):
            logits = rms_linear(x, norm_w, eps, lm_w)
        else:
            logits = linear(rms_norm(x, norm_w, eps), lm_w)  # shape: [T, V]
        return logits, split_argmax(logits) if gemv else logits.argmax(dim=-1)

    return head


# -- the decoder ---------------------------------------------------------------------------------


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

    def packed(self) -> "_Layer":
        """This layer with its products' weights packed where gemv.pack_layout says so (new tensors)."""
        def packed(w):
            layout = pack_layout(*w.shape, w.numel() * w.element_size())
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


@dataclass
class StepBuffers:
    T: int
    staging: torch.Tensor  # device int64 [1 + 2T + T^2], read by the graph
    host: torch.Tensor  # host int64 (pinned on CUDA), the same layout
    logits: torch.Tensor | None = None  # [T, V]
    top: torch.Tensor | None = None  # [T] argmax
    aux: torch.Tensor | None = None  # [T, 3H] when capturing aux states
    graph: torch.cuda.CUDAGraph | None = None

    copied: torch.cuda.Event | None = None  # the last host -> device copy of `host`

    def __post_init__(self):
        self.host_np = self.host.numpy()


class FastDecoder:
    """Static-KV-cache batch-1 decoder over a Llama-family HF model's weights."""

    def __init__(
        self,
        model,
        *,
        max_len: int = 2048,
        aux_layer_ids: list[int] | None = None,
        last_state: str = "pre_norm",
        share_weights: bool = True,
        pad: int = 64,
    ):
        cfg = model.config
        check_supported(cfg, max_len)
        self.config = cfg
        self.shapes = s = Shapes.from_config(cfg)
        p0 = next(model.parameters())
        self.device, self.dtype = p0.device, p0.dtype
        self.max_len = max_len
        # Cache slots past max_len: padded rows of the last step and warm-up writes land there.
        self.cache_len = round_up(max_len + pad, 64)  # a multiple of 64 keeps mask rows aligned
        inner = model.model
        with torch.no_grad():
            self.layers = layer_weights(model, share_weights)
            self.embed = model.get_input_embeddings().weight.data
            self.norm_w = inner.norm.weight.data
            self.lm_w = model.get_output_embeddings().weight.data
            self.cos, self.sin = rope_tables(model, self.cache_len, self.device, self.dtype)
            # A layer's keys and values in one tensor [2, kv heads, slots, head size], so a step
            # writes both with one kernel.
            shape = (2, s.kv_heads, self.cache_len, s.head_dim)
            self.kv = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(s.num_layers)]
        self.aux_layer_ids = list(aux_layer_ids or [])
        self.last_state = last_state
        self._layer = make_layer_fn(s)
        # The row-major weights: every step's until optimize packs them, then the wide steps'.
        self._layer_args = self._wide_args = [lw.args() for lw in self.layers]
        self._prep = make_prep_fn(s, self.cache_len)
        self._head = make_head_fn(s)
        self.use_graphs = False
        self.compiled = False
        self.compile_seconds = 0.0
        self._bufs: dict[tuple[int, bool], StepBuffers] = {}
        self._compact: dict[int, tuple] = {}

    # -- setup ---------------------------------------------------------------------------
    def optimize(self, *, compile: bool = True, cuda_graphs: bool = True, mode: str | None = None,
                 coordinate_descent: bool = True, gemv: bool | None = None,
                 attention_kernel: bool | None = None, pack: bool | None = None) -> "FastDecoder":
        """Compile the step functions with inductor (`mode` is torch.compile's; the default fuses
        without autotuning matmuls) and capture each step as a CUDA graph on first use.

        `coordinate_descent` sets inductor's coordinate_descent_tuning, which also turns every
        matrix-vector product (one token) into a tuned Triton reduction instead of a cuBLAS GEMV.
        `gemv` routes the products of steps of up to gemv.ROWS_MAX tokens through gemv.py's Triton
        kernels instead, each RMSNorm and residual add folded into its product (None: wherever
        Triton runs, i.e. on CUDA), and `attention_kernel` (None: as `gemv`) the attention of steps
        that fit decode_attention.py's kernels through them. `pack` (None: gemv.PACK_WEIGHTS) gives
        the kernels a packed copy of each product's weight (gemv.pack_layout). Graphs captured before
        are dropped."""
        if self.device.type != "cuda" and cuda_graphs:
            raise SpecdecError("CUDA graphs need a CUDA device; found " + str(self.device))
        if gemv is None:
            gemv = self.device.type == "cuda" and gemv_kernels.available()
        self._bufs.clear()
        self._compact.clear()
        self._layer = make_layer_fn(self.shapes, gemv, attention_kernel)
        self._prep = make_prep_fn(self.shapes, self.cache_len)
        self._head = make_head_fn(self.shapes, gemv)
        # The kernels' packed weights, a second copy (the previous packing is dropped first). Steps
        # of more tokens than the kernels take (prefill chunks, large trees) keep reading the
        # row-major weights: a packed one would be unpacked, a copy of the weight, on every such step.
        if pack is None:
            pack = gemv_kernels.PACK_WEIGHTS  # read now: benchmarks set it between builds
        self._layer_args = []
        self._layer_args = [(lw.packed() if gemv and pack else lw).args() for lw in self.layers]
        if compile:
            import torch._inductor.config as ic

            ic.coordinate_descent_tuning = coordinate_descent
            ic.triton.unique_kernel_names = True
            if hasattr(ic, "fx_graph_cache"):
                ic.fx_graph_cache = True
            import torch._dynamo.config as dc

            # One compiled graph per (bucket size, dtype): more than dynamo's default of 8.
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(dc, name):
                    setattr(dc, name, max(64, getattr(dc, name)))
            if hasattr(dc, "accumulated_recompile_limit"):
                dc.accumulated_recompile_limit = max(1024, dc.accumulated_recompile_limit)
            opts = dict(dynamic=False, fullgraph=True)
            if mode:
                opts["mode"] = mode
            self._layer = torch.compile(self._layer, **opts)
            self._prep = torch.compile(self._prep, **opts)
            self._head = torch.compile(self._head, **opts)
        self.compiled = compile
        self.use_graphs = cuda_graphs
        return self

    def _buffers(self, T: int, capture: bool) -> StepBuffers:
        key = (T, capture)
        b = self._bufs.get(key)
        if b is not None:
            return b
        n = 1 + 2 * T + T * T
        host = torch.zeros(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        b = StepBuffers(T=T, staging=torch.zeros(n, dtype=torch.int64, device=self.device), host=host)
        # Warm-up and capture write the cache: aim them at the scratch slots past max_len.
        self._fill(b, [0] * T, list(range(T)), self.cache_len - T, _causal(T))
        b.staging.copy_(b.host)
        if not self.use_graphs:
            self._bufs[key] = b
            return b
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):  # compile, then one clean run (inductor allocates lazily)
                self._run(b.staging, capture)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.no_grad():
            b.logits, b.top, b.aux = self._run(b.staging, capture)
        b.graph = g
        torch.cuda.synchronize()
        self.compile_seconds += time.perf_counter() - t0
        self._bufs[key] = b
        return b

    def warmup(self, buckets: list[int], capture: bool = False) -> None:
        for T in buckets:
            self._buffers(T, capture)

    def buffers(self, T: int, capture: bool = False) -> StepBuffers | None:
        """The buffers of bucket T if it has been built (warmed up or run), else None."""
        return self._bufs.get((T, capture))

    # -- one step ------------------------------------------------------------------------
    def _run(self, staging: torch.Tensor, capture: bool):
        x, cos, sin, slots, mask, tm = self._prep(staging, self.embed, self.cos, self.sin)
        states = {}
        L = self.shapes.num_layers
        T = math.isqrt(staging.numel()) - 1  # the staging buffer holds (T + 1) ** 2 values
        for i, args in enumerate(self._layer_args if T <= ROWS_MAX else self._wide_args):
            if capture and i in self.aux_layer_ids:
                states[i] = x
            x = self._layer(x, *args, self.kv[i], cos, sin, slots, mask, tm)
        aux = None
        if capture:
            if L in self.aux_layer_ids:
                states[L] = rms_norm(x, self.norm_w, self.shapes.eps) if self.last_state == "post_norm" else x
            aux = torch.cat([states[i] for i in self.aux_layer_ids], dim=-1)
        logits, top = self._head(x, self.norm_w, self.lm_w)
        return logits, top, aux

    @staticmethod
    def _fill(b: StepBuffers, ids, pos, slot0: int, tmask: np.ndarray) -> None:
        """Write a step's inputs into the host staging buffer (numpy: ~1 us per field)."""
        T, n = b.T, len(ids)
        h = b.host_np
        h[0] = slot0
        h[1 : 1 + n] = ids
        h[1 + n : 1 + T] = 0
        h[1 + T : 1 + T + n] = pos
        h[1 + T + n : 1 + 2 * T] = pos[-1]
        h[1 + 2 * T :] = tmask.reshape(-1)

    def step(self, ids: list[int], pos: list[int], slot0: int, tmask: np.ndarray, T: int,
             capture: bool = False) -> StepBuffers:
        """Run one step of bucket T (len(ids) <= T; the rest is padding). Returns the buffers
        holding logits/top/aux (valid until the next step of the same bucket)."""
        b = self.stage(ids, pos, slot0, tmask, T, capture)
        self.run(b, capture)
        return b

    def stage(self, ids: list[int], pos: list[int], slot0: int, tmask: np.ndarray, T: int,
              capture: bool = False) -> StepBuffers:
        """The first half of `step`: the inputs on their way to the device (queued on the current
        stream, so work queued after it may still edit `staging` before `run`)."""
        if slot0 + T > self.cache_len:
            raise SpecdecError(f"cache of {self.cache_len} slots is full (slot {slot0} + {T})")
        b = self._buffers(T, capture)
        if b.copied is not None:
            # The pinned host buffer may still be in flight to the device (back-to-back steps
            # without a read in between, as in a chunked prefill): wait for that copy only.
            b.copied.synchronize()
        self._fill(b, ids, pos, slot0, tmask)
        b.staging.copy_(b.host, non_blocking=True)
        if self.device.type == "cuda":
            if b.copied is None:
                b.copied = torch.cuda.Event()
            b.copied.record()
        return b

    def run(self, b: StepBuffers, capture: bool = False) -> None:
        """The second half of `step`: the staged step, replayed (or run without graphs)."""
        if b.graph is not None:
            b.graph.replay()
        else:
            with torch.no_grad():
                b.logits, b.top, b.aux = self._run(b.staging, capture)

    # -- cache edits -----------------------------------------------------------------------
    def compact(self, dst_start: int, src: list[int]) -> None:
        """Move cache slots `src` to dst_start.. in every layer (an accepted tree path)."""
        n = len(src)
        if not self.use_graphs:
            idx = torch.tensor(src, device=self.device)
            dst = torch.arange(dst_start, dst_start + n, device=self.device)
            for kv in self.kv:
                kv.index_copy_(2, dst, kv.index_select(2, idx))
            return
        width = 1 << max(0, (n - 1).bit_length())
        entry = self._compact.get(width)
        if entry is None:
            buf = torch.full((2, width), self.cache_len - 1, dtype=torch.int64, device=self.device)
            host = torch.empty((2, width), dtype=torch.int64, pin_memory=True)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for kv in self.kv:
                    kv.index_copy_(2, buf[1], kv.index_select(2, buf[0]))
            entry = self._compact[width] = (g, buf, host)
        g, buf, host = entry
        host.fill_(self.cache_len - 1)  # padding copies the scratch slot onto itself
        host[0, :n] = torch.tensor(src)
        host[1, :n] = torch.arange(dst_start, dst_start + n)
        buf.copy_(host)  # synchronous: the pinned buffer is rewritten by the next compaction
        g.replay()

    # -- whole prompts -------------------------------------------------------------------
    def prefill(self, prompt_ids: list[int], chunk: int, capture: bool = False):
        """Fill the cache with the prompt in chunks of `chunk` tokens. Returns (logits of the last
        prompt token [V], its argmax as a 0-d device tensor, aux [len(prompt), 3H] or None)."""
        auxes = []
        P = len(prompt_ids)
        b = None
        for start in range(0, P, chunk):
            ids = prompt_ids[start : start + chunk]
            b = self.step(ids, list(range(start, start + len(ids))), start, _causal(chunk), chunk, capture)
            if capture:
                auxes.append(b.aux[: len(ids)].clone())
            last = len(ids) - 1
        aux = torch.cat(auxes) if capture else None
        return b.logits[last], b.top[last], aux


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


_CAUSAL: dict[int, np.ndarray] = {}


def _causal(T: int) -> np.ndarray:
    """The chain mask [T, T] (lower triangle, int64 as the staging buffer holds it)."""
    m = _CAUSAL.get(T)
    if m is None:
        m = _CAUSAL[T] = np.tril(np.ones((T, T), dtype=np.int64))
    return m


def rope_tables(model, n: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, head_dim] from a fresh copy of the model's own rotary module (its buffers may
    be uninitialised after a meta-device build), computed on CPU in fp32 then cast like HF."""
    rot = model.model.rotary_emb
    fresh = type(rot)(config=model.config)
    pos = torch.arange(n)[None]
    cos, sin = fresh(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0].to(device=device, dtype=dtype), sin[0].to(device=device, dtype=dtype)


# -- the engine -----------------------------------------------------------------------------------


class FastEngine(SpeculativeEngine):
    """Same API and lossless acceptance as `SpeculativeEngine`, on a `FastDecoder`.

    Buckets (one compiled step and one CUDA graph each): 1 (plain, or an empty draft), k+1 (a
    chain draft, padded), the tree size + 1 (a tree draft) and `prefill_chunk`."""

    _context_name = "the fast path's cache"
    _context_hint = "; pass a larger max_len"

    def __init__(
        self,
        target: Target,
        *,
        drafter=None,
        ngram: int | None = None,
        k: int = 5,
        tree: TreeConfig | None = None,
        proposer=None,
        max_len: int | None = None,
        prefill_chunk: int = 32,
        compile: bool | None = None,
        cuda_graphs: bool = True,
        mode: str | None = None,
        coordinate_descent: bool | None = None,
        require_cuda: bool = True,
        decoder: FastDecoder | None = None,
        static_drafter: bool = True,
        pack_weights: bool | None = None,
        drafter_kernels: bool | None = None,
        steps_on_device: bool = True,
    ):
        """`decoder`: reuse another FastEngine's decoder (same target): its weights, cache and
        captured buckets are shared, so only new bucket sizes compile. `static_drafter`: greedy
        EAGLE-3 chains and trees draft with `StaticChainDrafter` / `StaticTreeDrafter` (compiled
        and in CUDA graphs on a GPU: a chain round of 5 in 0.66 ms against 9.5 ms eager on an H200,
        same drafts; benchmarks/drafter_step.py); False keeps the eager proposer (sampling always
        uses it). `compile`: inductor on the decoder's steps (default: on a CUDA GPU only; True
        compiles on a CPU too, as `make_engine`'s CPU fast path does). `pack_weights`: a packed
        second copy of the large products' weights for the kernels (`FastDecoder.optimize`'s `pack`;
        None: gemv.PACK_WEIGHTS, off). `drafter_kernels`: a static chain drafter's layer on the
        Triton kernels (eagle_kernels.py; None: on a GPU where they apply). `steps_on_device`: greedy
        plain steps and such a drafter's chain steps compute their next input on the device and the
        host reads a step while the next runs (`_device_steps`); False: the host builds every
        step's input from what it read (for chains two reads, the drafts then the argmax)."""
        if require_cuda and target.device.type != "cuda":
            raise SpecdecError(
                f"the fast path needs a CUDA GPU; the target is on {target.device}; use the "
                f"reference engine (SpeculativeEngine), which runs anywhere"
            )
        super().__init__(target, drafter=drafter, ngram=ngram, k=k, tree=tree, proposer=proposer)
        ctx = getattr(target.config, "max_position_embeddings", None) or 4096
        self.max_len = min(max_len or 2048, ctx)  # prompt + new tokens
        self.buckets = sorted({1, k + 1} | ({tree.total_tokens + 1} if tree else set()))
        self.prefill_chunk = prefill_chunk
        # Slots past max_len: a last verify step's draft and padding, a padded prefill chunk, and
        # the scratch slot that warm-ups and padded copies write.
        # At least 64 + chunk, so a decoder shared by engines of other k (<= 63) still fits.
        pad = max(self.buckets[-1], 64) + prefill_chunk + 1
        on_cuda = target.device.type == "cuda"
        compile = on_cuda if compile is None else compile
        self.static = None
        self.steps_on_device = steps_on_device
        self._reads = None  # _device_steps' pinned read buffers and their events
        if isinstance(self.proposer, Eagle3Proposer) and static_drafter:
            kw = dict(max_len=self.max_len, cuda_graphs=on_cuda and cuda_graphs, compile=compile and on_cuda)
            self.static = (StaticChainDrafter(self.proposer.drafter, k=k, kernels=drafter_kernels, **kw)
                           if tree is None else StaticTreeDrafter(self.proposer.drafter, tree=tree, **kw))
        if decoder is not None:
            if decoder.cache_len < self.max_len + pad:
                raise SpecdecError(f"the shared decoder's cache ({decoder.cache_len} slots) is too small")
            self.fast = decoder
            return
        self.fast = FastDecoder(target.model, max_len=self.max_len, aux_layer_ids=target.aux_layer_ids,
                                last_state=target.last_state, pad=pad)
        if coordinate_descent is None:
            coordinate_descent = prefer_coordinate_descent(target.model)
        if on_cuda or not require_cuda:
            self.fast.optimize(compile=compile, cuda_graphs=cuda_graphs and on_cuda,
                               mode=mode, coordinate_descent=coordinate_descent, pack=pack_weights)

    def warmup(self) -> float:
        """Compile and capture every bucket now; returns the seconds it took."""
        t0 = time.perf_counter()
        capture = isinstance(self.proposer, Eagle3Proposer)
        self.fast.aux_layer_ids = list(self.target.aux_layer_ids)
        self.fast.warmup(sorted(set(self.buckets) | {self.prefill_chunk}), capture)
        if self.static is not None:
            self.static.warm()
        b = self.fast.buffers(self.k + 1, capture)
        if isinstance(self.static, StaticChainDrafter) and b is not None and b.graph is not None:
            self.static.attach(b.top, b.aux)  # and its commit of a verify step's outputs, captured
            self.static.commit_verified()
        return time.perf_counter() - t0

    def _bucket(self, n: int) -> int:
        for T in self.buckets:
            if T >= n:
                return T
        raise SpecdecError(f"a draft of {n - 1} tokens exceeds the largest verify bucket {self.buckets[-1] - 1}")

    @torch.no_grad()
    def generate_iter(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        gen, stops = self._begin(prompt_ids, params)
        dev = self.target.device
        greedy = params.temperature <= 0
        eagle = isinstance(self.proposer, Eagle3Proposer)
        static = self.static if eagle and greedy else None
        self.fast.aux_layer_ids = list(self.target.aux_layer_ids)
        logits, top, aux = self.fast.prefill(list(prompt_ids), self.prefill_chunk, capture=eagle)
        last = int(top) if greedy else sample(target_probs(logits.float(), params), gen)
        context = list(prompt_ids) + [last]
        if static is not None:
            static.begin(aux, torch.tensor(context[1:], device=dev))
        elif eagle:
            self.proposer.reset(len(prompt_ids) + params.max_new_tokens + 64)
            self.proposer.commit(aux[None], torch.tensor(context[1:], device=dev))
        elif self.proposer is not None:
            self.proposer.reset(prompt_ids)
        produced = 1
        finished = last in stops or produced >= params.max_new_tokens
        yield StepOutput(token_ids=[last], finished=finished,
                         finish_reason=("stop" if last in stops else "length") if finished else None)
        on_device = isinstance(static, StaticChainDrafter) or (greedy and self.proposer is None)
        if on_device and self.steps_on_device and not finished:
            yield from self._device_steps(static, context, produced, params.max_new_tokens, stops)
            return
        while not finished:
            P = len(context) - 1  # tokens in the cache; context[-1] is not yet in it
            budget = params.max_new_tokens - produced
            if static is not None:
                draft = static.propose()
            elif eagle:
                draft = self.proposer.propose(params, gen, self.target.vocab_size)
            elif self.proposer is not None:
                draft = self.proposer.propose(context, min(self.k, budget))
            else:
                draft = Draft()
            n = len(draft)
            T = self._bucket(n + 1)
            depths = draft.depths()
            pos = [P] + [P + 1 + d for d in depths]
            tmask = _tree_mask(draft.parents, T) if n and not draft.is_chain else _causal(T)
            b = self.fast.step([context[-1], *draft.tokens], pos, P, tmask, T, capture=eagle)
            if greedy:
                path, bonus = _greedy_walk(draft, b.top[: n + 1].tolist())
            else:
                path, bonus = self._accept(draft, b.logits[: n + 1].float(), params, gen)
            if path and path != list(range(len(path))):
                self.fast.compact(P + 1, [P + 1 + i for i in path])
            new_tokens = [draft.tokens[i] for i in path] + [bonus]
            if eagle:
                rows = torch.tensor([0] + [1 + i for i in path], device=dev)
                if static is not None:
                    static.commit(b.aux[rows], torch.tensor(new_tokens, device=dev))
                else:
                    self.proposer.commit(b.aux[rows][None], torch.tensor(new_tokens, device=dev))
            out = step_output(new_tokens, len(path), max(depths, default=-1) + 1, n, context, produced,
                              params.max_new_tokens, stops)
            produced += len(out.token_ids)
            finished = out.finished
            yield out

    def _device_steps(self, static: StaticChainDrafter | None, context: list[int], produced: int, max_new: int,
                      stops) -> Iterator[StepOutput]:
        """Greedy steps whose next input the device computes, plain (`static` None) or EAGLE-3
        chains: after a verify the drafter commits what the target accepted (counted on the device)
        and drafts the next round, and the staging buffer advances on the device (slot and
        positions by the committed count, the target's own token at the front, the new drafts
        behind it). The host only reads each step's drafts and argmax (one pinned copy per step),
        and reads step n while step n + 1 runs: it queues a step before walking the previous one
        wherever that one cannot end the request by length, so the GPU does not wait for the
        host's bookkeeping between steps."""
        k = 0 if static is None else self.k
        T, capture = k + 1, static is not None
        cuda = self.target.device.type == "cuda"
        chain = list(range(-1, k - 1))
        P = len(context) - 1
        b = self.fast.stage([context[-1]] + [0] * k, list(range(P, P + T)), P, _causal(T), T, capture=capture)
        st = b.staging
        one = torch.ones((), dtype=torch.long, device=st.device)
        # Two pinned read buffers, drafts then argmax: step n's is read while step n + 1 is queued.
        # Kept across requests (pinning memory costs more than a step).
        if self._reads is None or self._reads[0][0].numel() != k + T:
            self._reads = ([torch.empty(k + T, dtype=torch.long, pin_memory=cuda) for _ in range(2)],
                           [torch.cuda.Event() if cuda else None for _ in range(2)])
        hosts, ready = self._reads
        if static is not None:
            static.draft()  # the first round, from the prompt begin() committed

        def queue(n: int) -> None:
            if static is not None:
                st[2 : 1 + T].copy_(static.drafts)  # ids[1:]
            self.fast.run(b, capture=capture)
            h = hosts[n % 2]
            if static is not None:
                h[:k].copy_(static.drafts, non_blocking=cuda)
            h[k:].copy_(b.top[:T], non_blocking=cuda)
            if cuda:
                ready[n % 2].record()
            if static is not None:
                static.attach(b.top, b.aux)
                static.commit_verified()  # in_n = accepted + 1
                static.draft()
            n_new = one if static is None else static.in_n
            st[1:2].copy_(b.top.index_select(0, n_new.view(1) - 1))  # the target's own token
            st[0:1].add_(n_new)  # slot0
            st[1 + T : 1 + 2 * T].add_(n_new)  # rope positions

        queue(0)
        queued = 1
        for n in itertools.count():
            if queued == n + 1 and produced + T < max_new:  # step n cannot end the request by length
                queue(queued)
                queued += 1
            if cuda:
                ready[n % 2].synchronize()
            values = hosts[n % 2].tolist()
            path, bonus = _greedy_walk(Draft(tokens=values[:k], parents=chain), values[k:])
            new_tokens = values[: len(path)] + [bonus]
            out = step_output(new_tokens, len(path), k, k, context, produced, max_new, stops)
            produced += len(out.token_ids)
            yield out
            if out.finished:
                return  # a step queued past the end is left to run; begin() and prefill reset the state
            if queued == n + 1:
                queue(queued)
                queued += 1


def prefer_coordinate_descent(model, threshold_bytes: int = 2 << 30) -> bool:
    """Measured on an H200 (BENCHMARKS.md): inductor's coordinate-descent mode (one-token
    matmuls as tuned Triton reductions) wins for small models, whose step is latency-bound
    (SmolLM2-135M: 0.93 vs 1.17 ms), and loses for large ones, where cuBLAS's GEMV streams
    weights faster (Llama-3.1-8B shapes: 5.67 vs 4.81 ms). The switch is the weight size."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return nbytes < threshold_bytes


def _greedy_walk(draft: Draft, top: list[int]) -> tuple[list[int], int]:
    """Longest draft path whose every token is the target's argmax at its parent; the bonus
    token is the argmax after the path. `top[0]` is the root's row, `top[1 + i]` node i's."""
    children = draft.children()
    path: list[int] = []
    node = -1
    while True:
        best = top[0 if node < 0 else 1 + node]
        match = next((c for c in children.get(node, []) if draft.tokens[c] == best), None)
        if match is None:
            return path, best
        path.append(match)
        node = match


def _tree_mask(parents: list[int], T: int) -> np.ndarray:
    """[T, T] over [root, *nodes, padding]: row i sees j when j is i or an ancestor."""
    n = len(parents)
    m = np.eye(T, dtype=np.int64)
    m[1 : 1 + n, 0] = 1
    m[1 : 1 + n, 1 : 1 + n] = ancestor_mask(parents).numpy()
    return m


# The CPU fast path: the same decoder compiled by inductor's C++ backend, no CUDA graphs. On a
# 2-core AMD EPYC with AVX512-BF16 (`specdec bench`, SmolLM2-135M-Instruct in bf16, the
# GPU-trained drafter; BENCHMARKS.md "The CPU fast path"): plain 22.6 tok/s against 15.5 for the
# reference engine, EAGLE-3 k = 3 31.7 against 22.0. Compiling takes 5-20 s per step size, which
# a model of a few million parameters never earns back. bf16 only: in fp32 the compiled step gains
# only with a short static cache (benchmarks/cpu_fast_path.py, 2-core AMD EPYC: 13.5 against 9.8
# tok/s at max_len 512, 10.9 against 10.8 at 2048, which eval uses), and the quickstart's
# evaluation on it took 304 s against 202 on the reference engine (compiles included).
CPU_FAST_MIN_PARAMS = 50_000_000


def cpu_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would find, or None."""
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


def cpu_fast_path_blocker(target: Target) -> str | None:
    """Why the CPU fast path does not apply to `target` (None: it does)."""
    if target.dtype != torch.bfloat16:
        return f"the target is {str(target.dtype).replace('torch.', '')} on a CPU (the fast path there is bf16)"
    n = sum(p.numel() for p in target.model.parameters())
    if n < CPU_FAST_MIN_PARAMS:
        return f"the target has {n:,} parameters; compiling would cost more than it saves below {CPU_FAST_MIN_PARAMS:,}"
    if cpu_compiler() is None:
        return "no C++ compiler (g++, c++ or clang++) for inductor's CPU backend"
    return None


def engine_kind(engine) -> str:
    """"fast" or "reference": the name every command's output uses for the engine that ran."""
    return "fast" if isinstance(engine, FastEngine) else "reference"


def make_engine(target: Target, *, fast: bool | None = None, **kwargs) -> SpeculativeEngine:
    """The fast engine when the target is a supported architecture on a CUDA GPU, or in bf16 on a
    CPU (compiled, see `cpu_fast_path_blocker`), else the reference engine (`fast=True` makes a
    fallback an error; `fast=False` forces the reference). Keyword arguments the reference engine
    does not take are dropped for it."""
    reason = None
    on_cpu = target.device.type == "cpu"
    if fast is not False:
        if target.device.type not in ("cuda", "cpu"):
            reason = f"the target is on {target.device}"
        else:
            try:
                check_supported(target.config, kwargs.get("max_len"))
            except SpecdecError as e:
                reason = str(e)
            if reason is None and on_cpu:
                reason = cpu_fast_path_blocker(target)
    ref_kw = {k: v for k, v in kwargs.items() if k in ("drafter", "ngram", "k", "tree", "proposer")}
    if fast is False or reason is not None:
        if fast is True:
            raise SpecdecError(f"the fast path does not apply: {reason}")
        return SpeculativeEngine(target, **ref_kw)
    if not on_cpu:
        return FastEngine(target, **kwargs)
    # On a CPU the eager proposer drafts: StaticChainDrafter compiled without CUDA graphs showed no
    # consistent gain over it (benchmarks/cpu_fast_path.py, BENCHMARKS.md) and costs a compile.
    engine = FastEngine(target, **{**kwargs, "require_cuda": False, "compile": True, "static_drafter": False})
    try:
        engine.warmup()  # compiles now, so a missing toolchain shows here and not mid-generation
    except Exception as e:
        if fast is True:
            raise
        warnings.warn(f"the CPU fast path failed to compile ({type(e).__name__}: {str(e)[:200]}); "
                      "using the reference engine", stacklevel=2)
        return SpeculativeEngine(target, **ref_kw)
    return engine
