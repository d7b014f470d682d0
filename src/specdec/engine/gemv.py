"""Few-token matrix products on CUDA as Triton kernels, for the fast path's decode and verify steps.

At one token a decode step is a chain of `weight @ x` products, memory-bound, and its speed is how
fast they stream their weights from HBM. `_gemv_kernel` streams them closer to the copy bandwidth
than cuBLAS's GEMV (benchmarks/profile_8b.py compares them), most of all on the square o_proj.
Each program streams BLOCK_N whole rows in BLOCK_K chunks, accumulates in fp32 and reduces
once: no split-K, so no second kernel and no atomics. The block sizes are autotuned per shape on
first use (which happens in the fast path's warm-up, before a CUDA graph captures the step).

Variants fold the small kernels around a product into it, since at one token each costs a
launch and a gap in the graph for microseconds of work:
    gemv_rms(x, g, w, eps)  = rms_norm(x, g) @ w.T       the sum of squares rides along the same
                                                         loop, the 1/rms scale is applied once
    gemv_add(x, w, r)       = r + x @ w.T                the residual add at the store
    gemv_rms_glu(x, g, w, eps) = silu(a) * b for [a | b] = rms_norm(x, g) @ w.T, w = [gate; up]:
                             the MLP's gate/up product, each program streaming a gate row and
                             its up row, so SiLU * up happens once per output at the store
All stay in fp32 up to the one rounding of the output, where HF rounds the normed x and the
product to bf16 on the way: the logits differ by that rounding, no more than cuBLAS's path
differs from HF's forward.

Over 2..rows_max rows (a verify step, KernelConfig) `gemv`, `gemv_rms` and `gemv_add` run `_rows_kernel`: the
weight as the tensor cores' wide operand and the tokens as the narrow one, padded to 16, its loads
software-pipelined (num_stages) and its block sizes autotuned, so the weight streams once for all
the step's tokens. Packed weights (`pack`) run `_rows_packed_kernel` instead.

Registered with `torch.library.triton_op`, so torch.compile traces through them and the kernels
land inside the compiled step and its CUDA graph. Without Triton or CUDA, `gemv_linear` is
`few_row_linear` (the CPU path); under Triton's interpreter the kernels run on CPU tensors
(tests/test_triton_kernels.py).
"""

from __future__ import annotations

import os

import torch

from ..models.cpu_products import few_row_linear
from .config import ROWS_KERNEL_MAX, KernelConfig
from .layer_math import rms_norm

try:  # Triton comes with CUDA builds of torch; CPU-only installs have it from the dev extra or not at all
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # pragma: no cover - exercised on CPU-only installs without the dev extra
    triton = None

# Under Triton's interpreter (TRITON_INTERPRET=1, which the test suite sets without a GPU) the same
# kernels run on CPU tensors, in numpy: slowly, but the kernel bodies themselves are tested.
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
_DEVICES = ("cuda", "cpu") if INTERPRETED else ("cuda",)


def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def runs_on(x: torch.Tensor) -> bool:
    """Whether the fast path's Triton kernels can take `x`: bf16 or fp16, on CUDA (or any device,
    under the interpreter)."""
    return triton is not None and x.device.type in _DEVICES and x.dtype in (torch.bfloat16, torch.float16)


if triton is not None:

    @triton.jit
    def _gemv_kernel(W, X, Y, G, R, N, eps, K: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                     GLU: tl.constexpr, LBN: tl.constexpr, LBK: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        # LBN = 0: W is row-major [N, K]; else packed [N / LBN, K / LBK, LBN, LBK] (see `pack`), each
        # row's chunk of BLOCK_K read in runs of min(BLOCK_K, LBK) contiguous elements. (Passed on
        # every launch: under torch.compile a constexpr left to its default arrived as None.)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            keep = cols < K
            x = tl.load(X + cols, mask=keep, other=0.0).to(tl.float32)
            if NORM:
                squares += x * x
                x = x * tl.load(G + cols, mask=keep, other=0.0).to(tl.float32)
            if LBN == 0:
                tile = rows[:, None] * K + cols[None, :]
            else:
                tile = ((rows // LBN) * (K * LBN) + (rows % LBN) * LBK)[:, None] + \
                    ((cols // LBK) * (LBN * LBK) + cols % LBK)[None, :]
            inside = (rows[:, None] < N) & keep[None, :]
            acc += tl.load(W + tile, mask=inside, other=0.0).to(tl.float32) * x[None, :]
            if GLU:  # W is [gate; up], 2N rows: this program also streams the up rows of its gate rows
                acc_up += tl.load(W + N * K + tile, mask=inside, other=0.0).to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if GLU:
            up = tl.sum(acc_up, axis=1)
        if NORM:
            inv = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
            y = y * inv
            if GLU:
                up = up * inv
        if GLU:
            y = y * tl.sigmoid(y) * up
        if RESIDUAL:
            y += tl.load(R + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rows < N)

    # Four warps keep more programs resident per SM, for more loads in flight on the narrow shapes.
    _gemv_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=1)
                 for bn in (2, 4, 8, 16) for bk in (512, 1024) for w in (4, 8)],
        key=["N", "K", "GLU"],
    )(_gemv_kernel)

    @triton.jit
    def _rows_kernel(W, X, Y, G, R, N, T, eps, K: tl.constexpr, TP: tl.constexpr, NORM: tl.constexpr,
                     RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
        # Y^T = W @ X^T: the weight is the tensor cores' 16+-row operand and the T <= TP tokens the
        # narrow one (padded to TP = 16 columns), so the weight streams once, with software
        # pipelining (num_stages), for every token of the step.
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.arange(0, TP)
        acc = tl.zeros((BLOCK_N, TP), dtype=tl.float32)
        squares = tl.zeros((TP,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            keep = cols < K
            w = tl.load(W + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & keep[None, :], other=0.0)
            x = tl.load(X + t[None, :] * K + cols[:, None], mask=(t[None, :] < T) & keep[:, None], other=0.0)
            if NORM:  # each token's sum of squares rides along; x * g is rounded for the tensor cores
                xf = x.to(tl.float32)
                squares += tl.sum(xf * xf, axis=0)
                x = (xf * tl.load(G + cols, mask=keep, other=0.0).to(tl.float32)[:, None]).to(x.dtype)
            if UPCAST:  # Triton's interpreter multiplies bf16 tiles wrongly; fp32 ones exactly
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(w, x, acc)
        if NORM:
            acc = acc * tl.rsqrt(squares / K + eps)[None, :]
        out = t[None, :] * N + rows[:, None]
        inside = (t[None, :] < T) & (rows[:, None] < N)
        if RESIDUAL:
            acc += tl.load(R + out, mask=inside, other=0.0).to(tl.float32)
        tl.store(Y + out, acc.to(Y.dtype.element_ty), mask=inside)

    def _rows_config(bn: int, bk: int, stages: int, warps: int = 4):
        return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)

    _ROWS_CONFIGS = ([_rows_config(bn, bk, st) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4)]
                     + [_rows_config(16, 512, st) for st in (2, 3)])
    # More bytes in flight per program (deeper pipelines, wider K chunks, 8 warps): the large
    # products (gate/up, o_proj, lm_head) stream faster with them (benchmarks/rows_configs.py).
    _ROWS_MORE = ([_rows_config(16, 128, 6), _rows_config(16, 256, 5), _rows_config(16, 512, 4),
                   _rows_config(16, 1024, 2), _rows_config(32, 512, 2), _rows_config(32, 512, 3)]
                  + [_rows_config(bn, bk, st, 8) for bn, bk, st in ((32, 256, 4), (64, 256, 3), (32, 512, 3),
                                                                   (64, 512, 2), (128, 128, 3))])
    _rows_tuned = {more: triton.autotune(configs=_ROWS_CONFIGS + (_ROWS_MORE if more else []),
                                         key=["N", "K", "NORM"])(_rows_kernel) for more in (False, True)}

    @triton.jit
    def _rows_packed_kernel(W, X, Y, G, R, N, T, eps, K: tl.constexpr, TP: tl.constexpr, NORM: tl.constexpr,
                            RESIDUAL: tl.constexpr, LBN: tl.constexpr, LBK: tl.constexpr, UPCAST: tl.constexpr):
        # `_rows_kernel` over a packed weight [N / LBN, K / LBK, LBN, LBK]: program pid streams its
        # LBN rows as K / LBK tiles, each one contiguous run of LBN * LBK elements.
        pid = tl.program_id(0)
        KB: tl.constexpr = K // LBK
        base = W + pid.to(tl.int64) * (KB * LBN * LBK)
        tile = tl.arange(0, LBN)[:, None] * LBK + tl.arange(0, LBK)[None, :]
        t = tl.arange(0, TP)
        acc = tl.zeros((LBN, TP), dtype=tl.float32)
        squares = tl.zeros((TP,), dtype=tl.float32)
        for kb in range(KB):
            cols = kb * LBK + tl.arange(0, LBK)
            w = tl.load(base + kb * (LBN * LBK) + tile)
            x = tl.load(X + t[None, :] * K + cols[:, None], mask=t[None, :] < T, other=0.0)
            if NORM:
                xf = x.to(tl.float32)
                squares += tl.sum(xf * xf, axis=0)
                x = (xf * tl.load(G + cols).to(tl.float32)[:, None]).to(x.dtype)
            if UPCAST:
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(w, x, acc)
        if NORM:
            acc = acc * tl.rsqrt(squares / K + eps)[None, :]
        rows = pid * LBN + tl.arange(0, LBN)
        out = t[None, :] * N + rows[:, None]
        inside = (t[None, :] < T) & (rows[:, None] < N)
        if RESIDUAL:
            acc += tl.load(R + out, mask=inside, other=0.0).to(tl.float32)
        tl.store(Y + out, acc.to(Y.dtype.element_ty), mask=inside)

    # The block sizes are the layout's; warps and pipeline depth are tuned around the best found on
    # Llama-3.1-8B's shapes (benchmarks/rows_variants.py).
    _rows_packed_tuned = triton.autotune(
        configs=[triton.Config({}, num_warps=w, num_stages=st) for w in (4, 8) for st in (3, 4)],
        key=["N", "K", "NORM", "LBN", "LBK"])(_rows_packed_kernel)
    # The one-token GEMV over a packed weight (any BLOCK_K: a row's chunk is read in runs of
    # min(BLOCK_K, LBK) contiguous elements).
    _gemv_packed_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=1)
                 for bn in (2, 4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8)],
        key=["N", "K", "GLU", "LBN", "LBK"])(_gemv_kernel)

    def _launch(x, w, g, r, eps: float, norm: bool, residual: bool, glu: bool = False,
                more: bool = True) -> torch.Tensor:
        """y [T, N] for x of T rows of K (T = 1: the GEMV; more: the rows kernel), w row-major
        [N, K] or packed (see `pack`); `more`: the rows kernel's autotuner also tries `_ROWS_MORE`
        (KernelConfig.rows_more_configs)."""
        k = in_features(w)
        t = x.numel() // k
        n = out_features(w) // 2 if glu else out_features(w)
        y = torch.empty(t, n, device=x.device, dtype=x.dtype)
        layout = dict(LBN=w.shape[2], LBK=w.shape[3]) if w.dim() == 4 else dict(LBN=0, LBK=0)
        packed = w.dim() == 4

        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]),)

        if t == 1:
            tuned = _gemv_packed_tuned if packed else _gemv_tuned
            plain, args = _gemv_kernel, (w, x, y, g, r, n, eps, k)
            flags = dict(NORM=norm, RESIDUAL=residual, GLU=glu, **layout)
        elif packed:  # the packed rows kernel's blocks are the layout's own
            args = (w, x, y, g, r, n, t, eps, k)
            flags = dict(TP=ROWS_KERNEL_MAX, NORM=norm, RESIDUAL=residual, UPCAST=not x.is_cuda, **layout)
            kernel = _rows_packed_tuned if x.is_cuda else _rows_packed_kernel
            wrap_triton(kernel)[(n // layout["LBN"],)](*args, **flags)
            return y
        else:
            tuned, plain, args = _rows_tuned[more], _rows_kernel, (w, x, y, g, r, n, t, eps, k)
            flags = dict(TP=ROWS_KERNEL_MAX, NORM=norm, RESIDUAL=residual, UPCAST=not x.is_cuda)
        # Block sizes are tuned per shape on the GPU; the interpreter has no timer to tune with.
        if x.is_cuda:
            wrap_triton(tuned)[grid](*args, **flags)
        else:
            wrap_triton(plain)[grid](*args, **flags, BLOCK_N=16, BLOCK_K=64)
        return y

    # Each op takes x as T contiguous rows of K ([K] or [T, K]) and returns [T, N]; `more` is
    # KernelConfig.rows_more_configs, an argument so that it keys torch.compile's graph cache.
    @triton_op("specdec::gemv", mutates_args={})
    def gemv(x: torch.Tensor, w: torch.Tensor, more: bool) -> torch.Tensor:
        """`x @ w.T` for a contiguous w [N, K]."""
        return _launch(x, w, x, x, 0.0, False, False, more=more)

    @triton_op("specdec::gemv_rms", mutates_args={})
    def gemv_rms(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, eps: float, more: bool) -> torch.Tensor:
        """`rms_norm(x, g) @ w.T`, each row normed on its own."""
        return _launch(x, w, g, x, eps, True, False, more=more)

    @triton_op("specdec::gemv_add", mutates_args={})
    def gemv_add(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, more: bool) -> torch.Tensor:
        """`r + x @ w.T` for a contiguous residual r of T rows of N."""
        return _launch(x, w, x, r, 0.0, False, True, more=more)

    @triton_op("specdec::gemv_rms_glu", mutates_args={})
    def gemv_rms_glu(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """`silu(a) * b` for [a | b] = `rms_norm(x, g) @ w.T`, w = [gate; up] of 2N rows; one row."""
        return _launch(x, w, g, x, eps, True, False, glu=True)


def out_features(weight: torch.Tensor) -> int:
    """N of a weight [N, K], row-major or packed [N / LBN, K / LBK, LBN, LBK]."""
    return weight.shape[0] * weight.shape[2] if weight.dim() == 4 else weight.shape[0]


def in_features(weight: torch.Tensor) -> int:
    """K of a weight [N, K], row-major or packed."""
    return weight.shape[1] * weight.shape[3] if weight.dim() == 4 else weight.shape[1]


def pack_layout(n: int, k: int, nbytes: int, min_bytes: int) -> tuple[int, int] | None:
    """The packed layout (LBN, LBK) for a weight [n, k] of `nbytes`, or None to keep it row-major:
    below `min_bytes` (KernelConfig.pack_min_bytes), or where the blocks do not divide it. The
    blocks are the rows kernel's fastest on Llama-3.1-8B's shapes for 8 tokens
    (benchmarks/rows_variants.py):
    128 x 256 for the wide gate/up, 32 x 512 for the long down rows, 64 x 256 for q/k/v and o."""
    if nbytes < min_bytes:
        return None
    lbn, lbk = (128, 256) if n >= 16384 else (32, 512) if k >= 8192 else (64, 256)
    return (lbn, lbk) if n % lbn == 0 and k % lbk == 0 else None


def pack(weight: torch.Tensor, layout: tuple[int, int]) -> torch.Tensor:
    """A row-major weight [N, K] as a new packed tensor [N / LBN, K / LBK, LBN, LBK]: block (i, j) of
    LBN rows and LBK columns is one contiguous run, which the kernels stream faster than LBN rows of
    LBK scattered K apart."""
    (n, k), (lbn, lbk) = weight.shape, layout
    return weight.view(n // lbn, lbn, k // lbk, lbk).permute(0, 2, 1, 3).contiguous()


def unpack(weight: torch.Tensor) -> torch.Tensor:
    """The row-major [N, K] of a packed weight (a copy; a row-major weight as it is)."""
    if weight.dim() != 4:
        return weight
    nb, kb, lbn, lbk = weight.shape
    return weight.permute(0, 2, 1, 3).reshape(nb * lbn, kb * lbk)


def _takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return runs_on(x) and weight.dtype == x.dtype and weight.is_contiguous()


def fused_one_token(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels apply: one bf16/fp16 row on CUDA, a contiguous weight of its dtype. The
    tests are on shapes, dtype and device, so under torch.compile they resolve while tracing."""
    return _takes(x, weight) and x.numel() == x.shape[-1]


def few_rows(x: torch.Tensor, weight: torch.Tensor, kernels: KernelConfig) -> bool:
    """Whether the rows kernel applies: 2..kernels.rows_max bf16/fp16 rows where Triton runs, a
    contiguous weight of their dtype."""
    return _takes(x, weight) and 1 < x.numel() // x.shape[-1] <= kernels.rows_max


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelConfig
                ) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: one bf16/fp16 row on CUDA through the Triton GEMV, up to
    kernels.rows_max through the rows kernel, the rest through `few_row_linear`."""
    if not (fused_one_token(x, weight) or few_rows(x, weight, kernels)):
        return few_row_linear(x, unpack(weight), bias)
    y = gemv(_rows(x), weight, kernels.rows_more_configs).view(*x.shape[:-1], out_features(weight))
    return y if bias is None else y + bias


def folds(x: torch.Tensor, weight: torch.Tensor, kernels: KernelConfig) -> bool:
    """Whether `rms_linear` and `linear_add` apply: one row (the GEMV) or, with kernels.rows_fold,
    2..rows_max (the rows kernel)."""
    return fused_one_token(x, weight) or (kernels.rows_fold and few_rows(x, weight, kernels))


def rms_linear(x: torch.Tensor, g: torch.Tensor, eps: float, weight: torch.Tensor, kernels: KernelConfig
               ) -> torch.Tensor:
    """`F.linear(rms_norm(x, g, eps), weight)` in one kernel (call only where `folds`)."""
    y = gemv_rms(_rows(x), g, weight, eps, kernels.rows_more_configs)
    return y.view(*x.shape[:-1], out_features(weight))


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, kernels: KernelConfig
               ) -> torch.Tensor:
    """`residual + F.linear(x, weight)` in one kernel (call only where `folds`)."""
    n = out_features(weight)
    y = gemv_add(_rows(x), weight, residual.reshape(-1, n).contiguous(), kernels.rows_more_configs)
    return y.view(*x.shape[:-1], n)


def norm_linear(x: torch.Tensor, g: torch.Tensor, eps: float, weight: torch.Tensor, kernels: KernelConfig
                ) -> torch.Tensor:
    """`F.linear(rms_norm(x, g, eps), weight)`, the norm folded into the product where `folds`;
    for every caller that runs its products on these kernels (the target's layer and head, the
    drafter's kernel layer)."""
    if folds(x, weight, kernels):
        return rms_linear(x, g, eps, weight, kernels)
    return gemv_linear(rms_norm(x, g, eps), weight, None, kernels)


def add_linear(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, kernels: KernelConfig
               ) -> torch.Tensor:
    """`residual + F.linear(x, weight)`, the add folded into the product's store where `folds`."""
    if folds(x, weight, kernels):
        return linear_add(x, weight, residual, kernels)
    return residual + gemv_linear(x, weight, None, kernels)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def folds_glu(weight: torch.Tensor, kernels: KernelConfig) -> bool:
    """Whether SiLU * up goes into the store of this gate/up product (KernelConfig.glu_fold_max_bytes)."""
    return weight.dim() == 2 and weight.numel() * weight.element_size() <= kernels.glu_fold_max_bytes


def rms_glu_linear(x: torch.Tensor, g: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for [gate | up] = `F.linear(rms_norm(x, g, eps), weight)` in one kernel, for
    weight = [gate; up] (call only where `fused_one_token`)."""
    return gemv_rms_glu(_rows(x), g, weight, eps).view(*x.shape[:-1], out_features(weight) // 2)
