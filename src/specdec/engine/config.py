"""The fast path's settings as two frozen objects, built once and passed down: `FastConfig`, how a
FastEngine builds and runs its decoder and drafter, and inside it `KernelConfig`, the kernels'
settings, which reach the layer builders (static_layers.py), the drafter's kernel layer
(eagle_kernels.py) and, as arguments, the Triton ops themselves (gemv.py, decode_attention.py).

Settings read inside an op's body (a block size, the autotuner's set) travel as op arguments, so
torch.compile bakes them into the graph and its cache key: a decoder built with other settings
compiles its own graph instead of being served one compiled before. Benchmarks compare variants by
building decoders with other configs (`with_step`), never by rewriting module constants.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


# The rows kernel pads a step's tokens to this many columns of the tensor cores' narrow operand
# (gemv.py's TP), so it takes at most this many rows.
ROWS_KERNEL_MAX = 16


@dataclass(frozen=True)
class KernelConfig:
    """The fast path's kernel settings (the shipped values are the defaults); invalid values are
    refused here, where they are built, rather than inside a kernel."""

    # Steps of 2..rows_max tokens (verification) run their products through the rows kernel
    # instead of cuBLAS (0: cuBLAS for every step of more than one token).
    rows_max: int = 16
    # Whether those steps also fold RMSNorm and the residual add into the rows kernel rather than
    # leaving them to one compiled kernel per norm. Folded, each program renormalises its slice of
    # x (the products slow a little) but ~3 kernels per layer go, which gains more.
    rows_fold: bool = True
    # Whether the rows kernel's autotuner also tries deeper pipelines, wider K chunks and 8 warps.
    rows_more_configs: bool = True
    # SiLU * up goes into the gate/up product's store up to this size of gate/up weight, and into a
    # compiled kernel between the MLP's two products above it: folding saves a small product's
    # extra kernel, while a large product streams slower with two accumulators, losing more than
    # that kernel costs.
    glu_fold_max_bytes: int = 32 << 20
    # Whether the products' weights of at least pack_min_bytes get a packed second copy for the
    # kernels (gemv.pack). Off by default: the copy costs those weights' memory again for a small
    # gain (contiguous blocks stream faster, most of all in verify steps). Smaller products stream
    # no faster packed.
    pack_weights: bool = False
    pack_min_bytes: int = 32 << 20
    # Cache slots per attention split program, for one-token steps and for steps of more tokens.
    # For verify steps fewer, larger blocks do not pay: the split kernel is bound by latency.
    attention_block: int = 32
    attention_step_block: int = 32
    attention_combine_chunk: int = 32  # partials summed per pass of the combine kernel
    # Query rows (tokens x query heads per kv head) up to which a step's attention runs as the
    # kernels: larger steps (trees, prefill chunks) keep the compiled attention, whose products
    # suit many rows.
    attention_max_rows: int = 32

    def __post_init__(self):
        from ..errors import SpecdecError

        if not 0 <= self.rows_max <= ROWS_KERNEL_MAX:
            raise SpecdecError(f"rows_max must be 0..{ROWS_KERNEL_MAX} (the rows kernel's width), got {self.rows_max}")
        for name in ("attention_block", "attention_step_block", "attention_combine_chunk"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):  # a Triton block: a power of two, tensor-core sized
                raise SpecdecError(f"{name} must be a power of two of at least 16, got {v}")
        if self.attention_max_rows < 0 or self.glu_fold_max_bytes < 0 or self.pack_min_bytes < 0:
            raise SpecdecError("attention_max_rows, glu_fold_max_bytes and pack_min_bytes must not be negative")

    def with_step(self, step: str) -> "KernelConfig | None":
        """This config with one benchmark plan step NAME=VALUE applied (a name in STEPS), or None
        when `step` is not such a step."""
        name, eq, value = step.partition("=")
        if not eq or name not in STEPS:
            return None
        field, convert = STEPS[name]
        return replace(self, **{field: convert(int(value))})


# Benchmark plan steps NAME=VALUE (benchmarks/roofline_8b.py, smollm2.py; bench.roofline.kernel_step)
# that change one setting for the variants built after them: the setting and how VALUE converts.
STEPS = {
    "glu": ("glu_fold_max_bytes", lambda v: 1 << 62 if v else 0),  # glu=1: always fold, 0: never
    "bs": ("attention_block", int),
    "sbs": ("attention_step_block", int),
    "rows": ("rows_max", int),
    "rowsfold": ("rows_fold", bool),
    "att": ("attention_max_rows", int),
    "rowscfg": ("rows_more_configs", bool),
    "pack": ("pack_weights", bool),
}


@dataclass(frozen=True)
class FastConfig:
    """How a FastEngine builds and runs (engine/fast.py). The defaults suit a CUDA GPU."""

    max_len: int | None = None  # prompt + new tokens (None: 2048, at most the target's context)
    prefill_chunk: int = 32  # prompt tokens per prefill step, one bucket of its own
    # inductor on the decoder's steps (None: on a CUDA GPU only; True compiles on a CPU too, as
    # `make_engine`'s CPU fast path does). `mode` is torch.compile's.
    compile: bool | None = None
    mode: str | None = None
    # inductor's coordinate descent tuning (None: where `prefer_coordinate_descent` says it pays)
    coordinate_descent: bool | None = None
    cuda_graphs: bool = True  # each bucket captured as a CUDA graph (CUDA only)
    require_cuda: bool = True  # refuse a target off CUDA (the CPU fast path turns it off)
    # Greedy EAGLE-3 chains and trees draft with the static drafters (compiled and in CUDA graphs on
    # a GPU: a round many times faster than eager, same drafts); False keeps the eager proposer
    # (sampling always uses it).
    static_drafter: bool = True
    # A static chain drafter's layer on the Triton kernels (eagle_kernels.py; None: on a GPU where
    # they apply).
    drafter_kernels: bool | None = None
    # Greedy plain steps and a kernel drafter's chain steps compute their next input on the device,
    # and the host reads a step while the next runs; False: the host builds every step's input
    # from what it read.
    steps_on_device: bool = True
    kernels: KernelConfig = KernelConfig()
