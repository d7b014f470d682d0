"""`specdec train`'s settings, one typed object built once and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class TrainConfig:
    out: str
    epochs: float = 10.0
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: float = 0.05  # fraction of total steps
    min_lr_ratio: float = 0.1
    grad_clip: float = 0.5
    batch_tokens: int = 8192
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    feature_loss: float = 0.0  # weight of the feature loss (train/ttt.py); 0 = EAGLE-3's CE only
    draft_vocab_size: int = 32000
    eval_percent: float = 5.0
    eval_every: int = 100
    save_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0
    max_steps: int | None = None
    rebuild_vocab: bool = False
    norm_before_residual: bool = False
    intermediate_size: int | None = None  # drafter MLP width; None: the target's
    # The drafter's layer starts as this target decoder layer: "auto" = the one that reads the top
    # aux state, where its shapes fit; "none" = random; or a layer index (negative from the end).
    init_layer: str | int = "auto"
    init_embed_half: str = "zero"  # the query/key/value columns that read the token: "zero" or "copy"
    bf16: bool | None = None  # bf16 autocast; None: where precision.compute_dtype says bf16
    # The TTT step's functions compiled (train/ttt.py, TTTSteps; train/loop.py, compiled_steps):
    # faster steps on a GPU, where an eager step launches thousands of small kernels from Python,
    # after the compiler's first minutes; off unless asked for, since only long runs repay them.
    compile: bool = False
    # On one GPU, each optimizer step (forward, backward, clipping, AdamW) recorded once per batch
    # shape as a CUDA graph and replayed (specdec/shape_graphs.py): the host no longer launches every
    # kernel. Eager or compiled steps alike; an online source's target forward too; elsewhere, and
    # under DDP, ignored.
    cuda_graphs: bool = False
    # The soft cross-entropy of every TTT step as one Triton kernel each way (train/fused_loss.py):
    # a few bytes of traffic per logit where the PyTorch ops make several passes over the logits.
    # CUDA with Triton (or its interpreter); the compiled step keeps its own fusion.
    fused_loss: bool = False
    # Batches padded to a length that is a multiple of this and to the rows batch_tokens holds at
    # that length (data.padded_shape): one shape per length bucket. 1: each batch's own shape.
    # CUDA graphs take data.GRAPH_LENGTH_MULTIPLE where this is left at 1.
    length_multiple: int = 1
    extra: dict = field(default_factory=dict)
