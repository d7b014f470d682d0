"""Which floating-point type to compute in, per device: the one convention for every command.

GPUs compute in bf16. CPUs compute in bf16 only where they have native bf16 dot products
(AVX512-BF16 or AMX): there a bf16 matrix product runs ~5x faster than fp32 (2-core AMD EPYC
with AVX512-BF16, 256x576 @ 576x1536: 810 against 160 GFLOPS), elsewhere bf16 is emulated and
slower than fp32.
"""

from __future__ import annotations

import functools

import torch


DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes: assume emulation
        return False


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on CUDA and on CPUs with native bf16, fp32 otherwise."""
    if torch.device(device).type == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def parse_dtype(name: str | torch.dtype | None, device: torch.device | str | None = None) -> torch.dtype:
    """--dtype values (bf16, fp16, fp32, and auto/None when `device` is given) to a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if (name is None or name == "auto") and device is not None:
        return compute_dtype(device)
    if str(name).lower() not in DTYPES:
        from .errors import SpecdecError

        raise SpecdecError(f"--dtype expects one of auto, bf16, fp16, fp32; found {name!r}")
    return DTYPES[str(name).lower()]
