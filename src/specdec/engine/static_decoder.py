"""The static decoder: a static-KV-cache, batch-1 decoder over a Llama-family HF model's weights,
every step (plain decode of 1 token, verification of k+1 tokens, a prefill chunk) one compiled
function and, on a GPU, one CUDA graph.

A step reads its inputs from one int64 staging buffer (one host-to-device copy) and the host reads
back only the argmax tokens (the accepted length follows from them), or the logits when sampling.

Layout of a step of T tokens (T is a captured bucket; shorter drafts are padded):
    staging = [slot0, ids[T], rope_pos[T], tree_mask[T*T]]
slot0 is the first cache slot written (= tokens already in the cache); row t attends to every
slot < slot0 and to the in-step slots its tree mask allows (lower triangle for a chain). Rope
positions are P + depth, slots are P + index, so trees and chains share one path. Rolling back
is a pointer move; an accepted tree path is compacted with one captured copy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SpecdecError
from . import gemv as gemv_kernels
from .config import KernelConfig
from .layer_math import rms_norm
from .static_layers import (Shapes, check_supported, layer_weights, make_head_fn, make_layer_fn, make_prep_fn,
                            rope_tables, round_up)


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
        self.kernel_config = KernelConfig()
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
                 attention_kernel: bool | None = None, kernel_config: KernelConfig | None = None) -> "FastDecoder":
        """Compile the step functions with inductor (`mode` is torch.compile's; the default fuses
        without autotuning matmuls) and capture each step as a CUDA graph on first use.

        `coordinate_descent` sets inductor's coordinate_descent_tuning, which also turns every
        matrix-vector product (one token) into a tuned Triton reduction instead of a cuBLAS GEMV.
        `gemv` routes the products of steps of up to kernel_config.rows_max tokens through gemv.py's
        Triton kernels instead, each RMSNorm and residual add folded into its product (None:
        wherever Triton runs, i.e. on CUDA), and `attention_kernel` (None: as `gemv`) the attention
        of steps that fit decode_attention.py's kernels through them. `kernel_config` (None: the
        shipped KernelConfig) holds the kernels' settings, packed weights among them (gemv.pack_layout).
        Graphs captured before are dropped."""
        if self.device.type != "cuda" and cuda_graphs:
            raise SpecdecError("CUDA graphs need a CUDA device; found " + str(self.device))
        if gemv is None:
            gemv = self.device.type == "cuda" and gemv_kernels.available()
        self.kernel_config = k = kernel_config or KernelConfig()
        self._bufs.clear()
        self._compact.clear()
        self._layer = make_layer_fn(self.shapes, gemv, attention_kernel, k)
        self._prep = make_prep_fn(self.shapes, self.cache_len)
        self._head = make_head_fn(self.shapes, gemv, k)
        # The kernels' packed weights, a second copy (the previous packing is dropped first). Steps
        # of more tokens than the kernels take (prefill chunks, large trees) keep reading the
        # row-major weights: a packed one would be unpacked, a copy of the weight, on every such step.
        self._layer_args = []
        self._layer_args = [(lw.packed(k.pack_min_bytes) if gemv and k.pack_weights else lw).args()
                            for lw in self.layers]
        if compile:
            import torch._dynamo.config as dc
            from torch._inductor import list_mode_options

            # One compiled graph per (bucket size, dtype), and decoders of several k share a
            # process: more than dynamo's default of 8. Dynamo has no per-function limit; this only
            # ever raises it.
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(dc, name):
                    setattr(dc, name, max(64, getattr(dc, name)))
            if hasattr(dc, "accumulated_recompile_limit"):
                dc.accumulated_recompile_limit = max(1024, dc.accumulated_recompile_limit)
            # Inductor's settings for these functions only (a `mode` spelled out as its options,
            # since torch.compile takes one or the other), never the process's.
            options = {**(list_mode_options(mode) if mode else {}), "coordinate_descent_tuning": coordinate_descent,
                       "triton.unique_kernel_names": True}
            opts = dict(dynamic=False, fullgraph=True, options=options)
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
        self._fill(b, [0] * T, list(range(T)), self.cache_len - T, causal_mask(T))
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
        for i, args in enumerate(self._layer_args if T <= self.kernel_config.rows_max else self._wide_args):
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

    def run_eager(self, b: StepBuffers, capture: bool = False):
        """The staged step run without its graph, every kernel launched (for profiling and for
        timing what the graph saves); returns (logits, top, aux)."""
        with torch.no_grad():
            return self._run(b.staging, capture)

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
            b = self.step(ids, list(range(start, start + len(ids))), start, causal_mask(chunk), chunk, capture)
            if capture:
                auxes.append(b.aux[: len(ids)].clone())
            last = len(ids) - 1
        aux = torch.cat(auxes) if capture else None
        return b.logits[last], b.top[last], aux


_CAUSAL_MASKS: dict[int, np.ndarray] = {}


def causal_mask(T: int) -> np.ndarray:
    """The chain mask [T, T] (lower triangle, int64 as the staging buffer holds it)."""
    m = _CAUSAL_MASKS.get(T)
    if m is None:
        m = _CAUSAL_MASKS[T] = np.tril(np.ones((T, T), dtype=np.int64))
    return m


def prefer_coordinate_descent(model, threshold_bytes: int = 2 << 30) -> bool:
    """Inductor's coordinate-descent mode (one-token matmuls as tuned Triton reductions) wins for
    small models, whose step is latency-bound, and loses for large ones, where cuBLAS's GEMV
    streams weights faster (benchmarks/roofline_8b.py measures both). The switch is the weight size."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return nbytes < threshold_bytes
