"""Which engine a command runs: the fast engine where it applies (a supported architecture on a
CUDA GPU, or a large enough bf16 target on a CPU, compiled by inductor's C++ backend without CUDA
graphs), else the reference engine. Every command builds its engine here.
"""

from __future__ import annotations

import shutil
import warnings
from dataclasses import replace

import torch

from ..errors import SpecdecError
from ..models.target import Target
from .config import FastConfig
from .engine import SpeculativeEngine
from .fast import FastEngine
from .static_layers import check_supported


# The CPU fast path: the same decoder compiled by inductor's C++ backend, no CUDA graphs. It pays
# for bf16 targets of tens of millions of parameters and more; compiling costs seconds per step
# size, which a model of a few million parameters never earns back. bf16 only: in fp32 the
# compiled step gains only with a short static cache, and compiling costs more than it saves
# over an evaluation (benchmarks/cpu_fast_path.py measures both).
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


def make_engine(target: Target, *, fast: bool | None = None, drafter=None, ngram: int | None = None, k: int = 5,
                tree=None, proposer=None, decoder=None, config: FastConfig = FastConfig()) -> SpeculativeEngine:
    """The fast engine when the target is a supported architecture on a CUDA GPU, or in bf16 on a
    CPU (compiled, see `cpu_fast_path_blocker`), else the reference engine (`fast=True` makes a
    fallback an error; `fast=False` forces the reference). `decoder` and `config` are the fast
    engine's (FastEngine); the reference engine takes the rest."""
    reason = None
    on_cpu = target.device.type == "cpu"
    if fast is not False:
        if target.device.type not in ("cuda", "cpu"):
            reason = f"the target is on {target.device}"
        else:
            try:
                check_supported(target.config, config.max_len)
            except SpecdecError as e:
                reason = str(e)
            if reason is None and on_cpu:
                reason = cpu_fast_path_blocker(target)
    common = dict(drafter=drafter, ngram=ngram, k=k, tree=tree, proposer=proposer)
    if fast is False or reason is not None:
        if fast is True:
            raise SpecdecError(f"the fast path does not apply: {reason}")
        return SpeculativeEngine(target, **common)
    if not on_cpu:
        return FastEngine(target, decoder=decoder, config=config, **common)
    # On a CPU the eager proposer drafts: StaticChainDrafter compiled without CUDA graphs gains
    # nothing consistent over it (benchmarks/cpu_fast_path.py) and costs a compile.
    cpu = replace(config, require_cuda=False, compile=True, static_drafter=False)
    engine = FastEngine(target, decoder=decoder, config=cpu, **common)
    try:
        engine.warmup()  # compiles now, so a missing toolchain shows here and not mid-generation
    except Exception as e:
        if fast is True:
            raise
        warnings.warn(f"the CPU fast path failed to compile ({type(e).__name__}: {str(e)[:200]}); "
                      "using the reference engine", stacklevel=2)
        return SpeculativeEngine(target, **common)
    return engine
