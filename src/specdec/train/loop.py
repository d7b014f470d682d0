"""`specdec train`: the EAGLE-3 drafter training loop.

AdamW with linear warmup and cosine decay, gradient clipping, bf16 autocast (on a GPU and on CPUs
with native bf16, see specdec.precision), checkpoints written atomically (a folder renamed into
place) with exact `--resume`, and every eval interval the per-position accuracy and a simulated
acceptance length on a held-out split, printed and sent to TensorBoard. Under torchrun the
drafter is wrapped in DDP (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from ..atomic import write_json
from ..dist import dist_env
from ..errors import SpecdecError
from ..models.drafter import DrafterConfig, Eagle3Drafter
from ..precision import compute_dtype, dtype_name
from ..shape_graphs import ShapeGraphs
from . import fused_loss
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data import GRAPH_LENGTH_MULTIPLE, global_batches, is_heldout, padded_shape, step_batches
from .drafter_init import copy_target_embedding, make_drafter
from .prefetch import Prefetch
from .step_graphs import hold_lr
from .ttt import EAGER, Batch, TargetArgmaxCache, TargetHead, TTTSteps, ttt_loss, walk_acceptance


class DrafterTTT(nn.Module):
    """The drafter plus its TTT loss as one module, so DDP sees a plain forward."""

    def __init__(self, drafter: Eagle3Drafter, head: TargetHead, steps: int, decay: float,
                 feature_weight: float = 0.0, fns: TTTSteps = EAGER):
        super().__init__()
        self.drafter = drafter
        self.head = head  # not a parameter or buffer: frozen, never synchronised
        self.steps, self.decay, self.feature_weight = steps, decay, feature_weight
        self.fns = fns  # the per-step functions, eager or compiled

    def forward(self, input_ids, loss_mask, aux_hidden, last_hidden, valid, target_argmax=None, walk=False):
        """(loss, correct, step_correct, counted), and with `walk` the engine's walk over the batch
        at k = steps and k = 5 as tokens [2] and steps [2] (`walk_acceptance`)."""
        out = ttt_loss(self.drafter, Batch(input_ids, loss_mask, aux_hidden, last_hidden, valid, target_argmax),
                       self.head, steps=self.steps, decay=self.decay, feature_weight=self.feature_weight, walk=walk,
                       fns=EAGER if walk else self.fns)  # evaluation's no-grad graphs would compile apart
        if not walk:
            return out.loss, out.correct, out.step_correct, out.counted
        walks = [walk_acceptance(out.depth, out.starts, k) for k in (self.steps, 5)]
        return (out.loss, out.correct, out.step_correct, out.counted,
                torch.tensor([w[0] for w in walks]), torch.tensor([w[1] for w in walks]))


def compiled_steps(backend: str = "inductor") -> TTTSteps:
    """The TTT step's functions compiled (`train --compile`): every step and every batch shape
    runs one graph each (sizes symbolic, `dynamic=True`); a graph break is an error, not a silent
    return to eager. Inductor's coalescing analysis for tiling asserts on some symbolic sizes (it
    is meant for static shapes), so it is off here, for these functions only."""
    options = None
    if backend == "inductor":
        options = {"triton.coalesce_tiling_analysis": False}
    return TTTSteps().compiled(dynamic=True, fullgraph=True, backend=backend, options=options)


def step_functions(cfg: TrainConfig, device: torch.device) -> TTTSteps:
    """The TTT step's functions `cfg` asks for: compiled, eager with the fused soft cross-entropy
    where its kernels run on `device`, or eager."""
    if cfg.compile:
        if cfg.fused_loss:
            log("specdec train: --fused-loss is for eager steps; the compiled step fuses its own loss")
        return compiled_steps()
    if cfg.fused_loss:
        if fused_loss.available(device):
            return TTTSteps(cross_entropy=fused_loss.fused_soft_cross_entropy)
        log("specdec train: --fused-loss needs CUDA with Triton; training with the PyTorch loss")
    return EAGER


def log(msg: str) -> None:
    if dist_env()[0] == 0:
        print(msg, file=sys.stderr, flush=True)


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _to(samples, device, dtype, shape=None):
    b = Batch.collate(samples, device, shape)
    return b.input_ids, b.loss_mask, b.aux_hidden.to(dtype), b.last_hidden, b.valid, b.target_argmax


@torch.no_grad()
def evaluate_heldout(module: DrafterTTT, source, indices, batch_tokens, device, dtype, autocast) -> dict:
    module.eval()
    correct = step_correct = None
    counted = 0.0
    walked = torch.zeros(2, 2, dtype=torch.long)  # (tokens, steps) at k = steps and k = 5
    for batch in global_batches(indices, source.lengths, batch_tokens, seed=0, epoch=0):
        with autocast():
            _, c, sc, n, tokens, steps = module(*_to(source.get(batch), device, dtype), walk=True)
        correct = c if correct is None else correct + c
        step_correct = sc if step_correct is None else step_correct + sc
        counted += float(n)
        walked += torch.stack([tokens.cpu(), steps.cpu()], 1)
    module.train()
    if not counted:
        return {}
    chain = (correct / counted).tolist()  # P(steps 0..s all right), over every position
    out = {
        "eval_positions": int(counted),
        "per_position_accuracy": [round(x, 4) for x in (step_correct / counted).tolist()],
        "chain_acceptance": [round(x, 4) for x in chain],
        "simulated_acceptance_length": 1 + sum(chain),
        "simulated_acceptance_length_k5": 1 + sum(chain[:5]),
    }
    if walked[0, 1]:
        # What the engine would measure on this text (tokens per step, walk_acceptance).
        out["walked_acceptance_length"] = float(walked[0, 0] / walked[0, 1])
        out["walked_acceptance_length_k5"] = float(walked[1, 0] / walked[1, 1])
    return out


def provenance(target, source, drafter, last_eval: dict) -> dict:
    """What `doctor` compares the served target and drafter against (see DrafterConfig)."""
    from ..capture.store import tokenizer_fingerprint

    tok = getattr(target, "tokenizer", None)
    root = getattr(getattr(source, "store", None), "directory", None)
    return {
        "target_fingerprint": target.fingerprint(),
        "tokenizer_fingerprint": tokenizer_fingerprint(tok, target.eos_token_ids) if tok is not None else None,
        "capture": str(root) if root is not None else None,
        "weight_norms": drafter.weight_norms(),
        "heldout": {k: last_eval[k] for k in ("walked_acceptance_length_k5", "per_position_accuracy")
                    if k in last_eval},
    }


def train(target, source, cfg: TrainConfig, *, init: str | None = None, resume: bool = False,
          target_name: str = "target", progress: bool = True, timings: dict | None = None) -> dict:
    """Train a drafter for `target` on `source`; returns the summary (also OUT/train_summary.json).
    `timings`: the caller's own set-up figures (load_target_s, read_data_s), reported beside train's."""
    if cfg.length_multiple < 1:
        raise SpecdecError(f"length multiple {cfg.length_multiple}: expected 1 (each batch its own shape) or more "
                           "(padded to a multiple of it); nothing was written")
    started = time.perf_counter()
    rank, world, _ = dist_env()
    cuda = torch.cuda.is_available() and target.device.type == "cuda"
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    heldout = [i for i, sid in enumerate(source.ids) if is_heldout(sid, cfg.eval_percent)]
    if not heldout and len(source.ids) > 1 and cfg.eval_percent > 0:
        heldout = [len(source.ids) - 1]
    held = set(heldout)
    train_idx = [i for i in range(len(source.ids)) if i not in held]
    if not train_idx:
        raise SpecdecError(f"no training samples: {len(source.ids)} samples, all held out; "
                           "add data or lower --eval-percent")
    ckpt = latest_checkpoint(out)
    if ckpt is not None and not resume:
        raise SpecdecError(f"{out} holds an earlier run's checkpoints (latest {ckpt.name}); nothing was changed: pass "
                           f"--resume to continue it, or another --out (or delete {out / 'checkpoints'}) to start over")
    drafter, info = make_drafter(target, source, cfg, None if ckpt else init)
    if ckpt:
        saved = DrafterConfig(**json.loads((ckpt / "drafter_config.json").read_text()))
        drafter = Eagle3Drafter(saved)
        copy_target_embedding(drafter, target)
    drafter.to(device)
    head = TargetHead.from_target(target).to(device)
    # CUDA graphs exist on CUDA only, and a recorded step would hold DDP's gradient exchange.
    graphs = cfg.cuda_graphs and cuda and world == 1
    if cfg.cuda_graphs and not graphs:
        log(f"specdec train: --cuda-graphs needs one GPU (here: {'world size ' + str(world) if cuda else 'no GPU'}); "
            "training without them")
    multiple = GRAPH_LENGTH_MULTIPLE if graphs and cfg.length_multiple == 1 else cfg.length_multiple
    module = DrafterTTT(drafter, head, cfg.ttt_steps, cfg.ttt_decay, cfg.feature_loss,
                        step_functions(cfg, device)).to(device)
    argmax_cache = TargetArgmaxCache(source, head, device)
    wrapped = module
    if world > 1:
        wrapped = nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if cuda else None)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=cuda,
                            capturable=graphs)
    per_epoch = len(global_batches(train_idx, source.lengths, cfg.batch_tokens, seed=cfg.seed, epoch=0,
                                   multiple=multiple))
    total = max(1, int(math.ceil(cfg.epochs * per_epoch)))
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    warmup = int(cfg.warmup * total)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, warmup, cfg.min_lr_ratio))
    step = 0
    history: list[dict] = []
    if ckpt:
        state = load_checkpoint(ckpt, drafter, opt, sched)
        step, history = state["step"], state.get("history", [])
        info["resumed_from"] = str(ckpt)
        log(f"specdec train: resuming from {ckpt} (step {step}/{total})")
    hold_lr(opt, device if graphs else None)  # after the scheduler read its base rate, and after a resume
    info["compiled"] = cfg.compile
    info["fused_loss"] = module.fns.cross_entropy is fused_loss.fused_soft_cross_entropy
    info["cuda_graphs"] = graphs
    info["length_multiple"] = multiple
    bf16 = compute_dtype(device) == torch.bfloat16 if cfg.bf16 is None else cfg.bf16
    dtype = torch.bfloat16 if bf16 else torch.float32

    def autocast():  # fp32 master weights and optimizer state; matrix products in bf16
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    tb = None
    if rank == 0:
        try:
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(str(out / "tensorboard"))
        except Exception:  # tensorboard is optional at run time
            tb = None
    info["setup_s"] = round(time.perf_counter() - started, 1)  # the vocab, the drafter's start, the optimizer
    info.update(timings or {})
    before = "".join(f", {k[:-2].replace('_', ' ')} {v:.0f} s" for k, v in (timings or {}).items())
    log(f"specdec train: {len(train_idx)} train / {len(heldout)} held-out samples, {per_epoch} batches/epoch, "
        f"{total} steps, world size {world}, draft vocab {drafter.cfg.draft_vocab_size} "
        f"(covers {info['vocab_coverage']:.1%} of assistant tokens; {info['vocab']}); "
        f"set up in {info['setup_s']:.0f} s{before}")

    from ..progress import progress_bar

    bar = progress_bar("stats", label="train", enabled=progress and rank == 0)
    task = bar.add_task("train", total=total, completed=step, stats="")
    tokens_seen, t0 = 0, time.perf_counter()
    last_eval: dict = history[-1] if history else {}
    last_loss = None

    def load(gb):
        shape = None
        if multiple > 1:
            rows, length = padded_shape(len(gb), max(source.lengths[i] for i in gb), cfg.batch_tokens, multiple)
            shape = (-(-rows // world), length)  # this process's share of the rows
        # With graphs an online source records the target's forward for the batch's padded shape too.
        with record_function("train: load batch"):  # named phases for a profiler; nothing without one
            samples = argmax_cache.get(gb[rank::world] or gb[:1], shape if graphs else None)
            return sum(len(s["input_ids"]) for s in samples), _to(samples, device, dtype, shape)

    def forward_backward(inputs):
        with autocast():
            loss, correct, _, counted = wrapped(*inputs)
        loss.backward()
        return loss, correct, counted

    def update(inputs) -> torch.Tensor:
        """One optimizer step; its figures as one tensor: loss, positions right at step 0, positions
        scored, gradient norm."""
        loss, correct, counted = forward_backward(inputs)
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        return torch.stack([t.detach().float() for t in (loss, correct[0], counted, gnorm)])

    def warm(inputs):  # before a shape's recording: the forward and backward, the weights left alone
        forward_backward(inputs)
        opt.zero_grad(set_to_none=True)

    recorded = ShapeGraphs(update, device, warm=warm, failure_hint="Train without --cuda-graphs; --resume continues "
                           "from the last checkpoint") if graphs else None

    def show(done):
        """A finished step's figures, read while the next step is already queued on a GPU."""
        nonlocal last_loss
        at, stats, lr = done
        with record_function("train: read figures"):  # waits for that step on a GPU
            loss, correct0, counted, gnorm = stats.tolist()
        last_loss = loss
        acc0 = correct0 / counted if counted else 0.0
        rate = tokens_seen / max(1e-9, time.perf_counter() - t0)
        bar.update(task, completed=at, stats=f"loss {loss:.3f} acc0 {acc0:.2f} {rate:,.0f} tok/s")
        if tb is not None:
            tb.add_scalar("train/loss", loss, at)
            tb.add_scalar("train/lr", lr, at)
            tb.add_scalar("train/grad_norm", gnorm, at)
            tb.add_scalar("train/tokens_per_s", rate, at)

    # A resume may start mid-epoch: step_batches locates the step, then walks the epochs forward.
    schedule = step_batches(step, total, train_idx, source.lengths, cfg.batch_tokens, seed=cfg.seed,
                            multiple=multiple)
    pending = None
    with bar:
        for n_tokens, inputs in Prefetch(load, schedule, device):
            opt.zero_grad(set_to_none=True)
            # The first step creates the optimizer's state, which a recorded step must find in place.
            with record_function("train: optimizer step"):
                stats = recorded(inputs) if recorded is not None and opt.state else update(inputs)
            sched.step()
            step += 1
            tokens_seen += n_tokens * world
            if pending is not None:
                show(pending)
            # The rate from the schedule on the host: the group's own may be a device tensor.
            pending = (step, stats, sched.base_lrs[0] * sched.lr_lambdas[0](sched.last_epoch))
            evaluate = heldout and (step % cfg.eval_every == 0 or step == total)
            save = rank == 0 and (step % cfg.save_every == 0 or step == total)
            if evaluate or save:
                show(pending)
                pending = None
            if evaluate:
                last_eval = {"step": step, **evaluate_heldout(module, argmax_cache, heldout, cfg.batch_tokens,
                                                              device, dtype, autocast)}
                history.append(last_eval)
                if rank == 0:
                    bar.console.print(
                        f"[eval step {step}] simulated acceptance length "
                        f"{last_eval.get('simulated_acceptance_length', 0):.2f} "
                        f"(k=5: {last_eval.get('simulated_acceptance_length_k5', 0):.2f}; as the engine "
                        f"steps: {last_eval.get('walked_acceptance_length_k5', 0):.2f}), per-position accuracy "
                        f"{last_eval.get('per_position_accuracy')}")
                    if tb is not None:
                        tb.add_scalar("eval/simulated_acceptance_length",
                                      last_eval.get("simulated_acceptance_length", 0), step)
                        tb.add_scalar("eval/walked_acceptance_length_k5",
                                      last_eval.get("walked_acceptance_length_k5", 0), step)
                        for i, a in enumerate(last_eval.get("per_position_accuracy", [])):
                            tb.add_scalar(f"eval/accuracy_pos{i}", a, step)
            if save:
                with record_function("train: checkpoint"):
                    save_checkpoint(out, step, drafter, opt, sched,
                                    {"step": step, "total": total, "history": history, "config": asdict(cfg)},
                                    cfg.keep_checkpoints)
        if pending is not None:
            show(pending)
    if world > 1:
        dist.barrier()
    info["cuda_graph_shapes"] = len(recorded.graphs) if recorded is not None else 0
    summary = {"steps": step, "tokens_per_s": tokens_seen / max(1e-9, time.perf_counter() - t0),
               "last_loss": last_loss, "eval": last_eval, "matmul_dtype": dtype_name(dtype), **info}
    if rank == 0:
        from ..models.formats import save_drafter

        drafter.cfg.provenance = provenance(target, source, drafter, last_eval)
        save_drafter(drafter, out / "drafter", "eagle3", target_name=target_name, dtype=torch.float32)
        write_json(out / "train_summary.json", summary)
        if tb is not None:
            tb.close()
    return summary
