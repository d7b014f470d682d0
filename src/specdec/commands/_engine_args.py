"""The flags that choose a target, a drafter and a drafting shape, shared by every command that
runs the engine (generate, eval, serve, bench), and the one function that turns them into an
engine."""

from __future__ import annotations

from ..errors import SpecdecError


def add_engine_args(p, *, target_required: bool = True, fast_path: bool = False) -> None:
    """`fast_path`: the command builds its engine with `make_engine` (the fast path where it
    applies) and offers --reference to opt out."""
    p.add_argument("--target", required=target_required, metavar="MODEL",
                   help="registry name (smollm2-135m-instruct), local HF folder, .gguf file or hub id")
    draft = p.add_mutually_exclusive_group()
    draft.add_argument("--drafter", metavar="DIR", help="EAGLE-3 drafter folder (eagle3 or speculators format)")
    draft.add_argument("--ngram", type=int, metavar="N", help="prompt-lookup drafting with n-grams up to N")
    p.add_argument("--k", "--num-speculative-tokens", dest="k", type=int, default=5, metavar="K",
                   help="draft tokens per step for chain drafting (default: 5)")
    p.add_argument("--tree-depth", type=int, metavar="D", help="draft an EAGLE-2-style tree this deep (drafter only)")
    p.add_argument("--tree-top-k", type=int, metavar="K", help="children per expanded tree node (default: 8)")
    p.add_argument("--tree-tokens", type=int, metavar="N", help="draft tokens per tree (default: 48)")
    p.add_argument("--device", help="cuda, cuda:1 or cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"],
                   help="default: bf16 on GPU, fp32 on CPU; auto: bf16 also on CPUs with native bf16 "
                        "(AVX512-BF16/AMX, faster decoding there)")
    if fast_path:
        p.add_argument("--reference", action="store_true",
                       help="use the reference engine even where the fast path applies (a CUDA GPU; bf16 "
                            "targets of 50M+ parameters on a CPU): no compile wait, any context length")
        add_pack_weights_arg(p)


def add_pack_weights_arg(p) -> None:
    p.add_argument("--pack-weights", action="store_true",
                   help="CUDA fast path: give the Triton kernels a second copy of each weight of 32 MB and "
                        "more, laid out in contiguous blocks; costs that memory again for a small gain, "
                        "larger when verifying several tokens than at one")


def kernel_config(args):
    """The fast path's kernel settings the command line chose."""
    from ..engine.config import KernelConfig

    return KernelConfig(pack_weights=args.pack_weights)


def tree_config(args):
    from ..engine.tree import TreeConfig

    flags = (args.tree_depth, args.tree_top_k, args.tree_tokens)
    if all(v is None for v in flags):
        return None
    if not getattr(args, "drafter", None):
        raise SpecdecError("--tree-depth/--tree-top-k/--tree-tokens need --drafter: n-gram lookup drafts chains only")
    for name, v in zip(("--tree-depth", "--tree-top-k", "--tree-tokens"), flags):
        if v is not None and v < 1:
            raise SpecdecError(f"{name} must be at least 1, got {v}")
    return TreeConfig(depth=args.tree_depth or 6, top_k=args.tree_top_k or 8, total_tokens=args.tree_tokens or 48)


def build_engine(args, target=None, *, max_len: int | None = None, fault=None):
    """(target, engine) from parsed flags; loads the target unless one is given. Commands that
    registered --reference get `make_engine`'s choice (the fast path, whose static cache holds
    `max_len` tokens, default 2048); the others the reference engine. `fault(drafter)` breaks the
    loaded drafter on purpose before the engine is built (serve --fault)."""
    from ..engine.engine import SpeculativeEngine
    from ..models.formats import load_drafter
    from ..models.target import load_target

    if args.k < 1:
        raise SpecdecError(f"--k must be at least 1, got {args.k}")
    if args.ngram is not None and args.ngram < 1:
        raise SpecdecError(f"--ngram must be at least 1, got {args.ngram}")
    tree = tree_config(args)
    if target is None:
        target = load_target(args.target, device=args.device, dtype=args.dtype)
    drafter = load_drafter(args.drafter, target, dtype=target.dtype) if args.drafter else None
    if fault is not None and drafter is not None:
        fault(drafter)
    if not hasattr(args, "reference"):
        return target, SpeculativeEngine(target, drafter=drafter, ngram=args.ngram, k=args.k, tree=tree)
    from ..engine.choice import make_engine

    from ..engine.config import FastConfig

    engine = make_engine(target, fast=False if args.reference else None, drafter=drafter, ngram=args.ngram,
                         k=args.k, tree=tree, config=FastConfig(max_len=max_len, kernels=kernel_config(args)))
    return target, engine
