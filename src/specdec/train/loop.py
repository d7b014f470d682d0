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
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..atomic import plain_mode, write_json
from ..dist import dist_env
from ..errors import SpecdecError
from ..models.drafter import DrafterConfig, Eagle3Drafter
from ..precision import compute_dtype, dtype_name
from .data import batches_at, global_batches, is_heldout
from .ttt import Batch, TargetArgmaxCache, TargetHead, ttt_loss, walk_acceptance
from .vocab import build_draft_vocab, count_tokens, coverage


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
    extra: dict = field(default_factory=dict)


class DrafterTTT(nn.Module):
    """The drafter plus its TTT loss as one module, so DDP sees a plain forward."""

    def __init__(self, drafter: Eagle3Drafter, head: TargetHead, steps: int, decay: float,
                 feature_weight: float = 0.0):
        super().__init__()
        self.drafter = drafter
        self.head = head  # not a parameter or buffer: frozen, never synchronised
        self.steps, self.decay, self.feature_weight = steps, decay, feature_weight

    def forward(self, input_ids, loss_mask, aux_hidden, last_hidden, valid, target_argmax=None, walk=False):
        """(loss, correct, step_correct, counted), and with `walk` the engine's walk over the batch
        at k = steps and k = 5 as tokens [2] and steps [2] (`walk_acceptance`)."""
        out = ttt_loss(self.drafter, Batch(input_ids, loss_mask, aux_hidden, last_hidden, valid, target_argmax),
                       self.head, steps=self.steps, decay=self.decay, feature_weight=self.feature_weight, walk=walk)
        if not walk:
            return out.loss, out.correct, out.step_correct, out.counted
        walks = [walk_acceptance(out.depth, out.starts, k) for k in (self.steps, 5)]
        return (out.loss, out.correct, out.step_correct, out.counted,
                torch.tensor([w[0] for w in walks]), torch.tensor([w[1] for w in walks]))


def log(msg: str) -> None:
    if dist_env()[0] == 0:
        print(msg, file=sys.stderr, flush=True)


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


FROZEN = "embed_tokens.weight"  # the drafter's one frozen tensor, a copy of the target's


def copy_target_embedding(drafter: Eagle3Drafter, target) -> None:
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.embed_tokens().weight.float().cpu())


def make_drafter(target, source, cfg: TrainConfig, init: str | None) -> tuple[Eagle3Drafter, dict]:
    """A new drafter sized for the target with a vocab from the data, or `--init` fine-tuning."""
    from ..models.formats import load_drafter

    info = {}
    masked, every = count_tokens(source.token_samples(), target.vocab_size)
    if init:
        drafter = load_drafter(init, target, dtype=torch.float32, device="cpu")
        if cfg.rebuild_vocab:
            ids = build_draft_vocab(masked, drafter.cfg.draft_vocab_size, every, target.eos_token_ids)
            drafter.set_vocab_mapping(ids)
            info["vocab"] = "rebuilt from data (--rebuild-vocab): lm_head rows re-learn from scratch"
        else:
            info["vocab"] = f"kept from {init} (d2t unchanged)"
    else:
        dcfg = DrafterConfig.for_target(target.config, draft_vocab_size=cfg.draft_vocab_size,
                                        aux_layer_ids=target.aux_layer_ids,
                                        norm_before_residual=cfg.norm_before_residual,
                                        **({"intermediate_size": cfg.intermediate_size}
                                           if cfg.intermediate_size else {}))
        torch.manual_seed(cfg.seed)
        drafter = Eagle3Drafter(dcfg)
        copy_target_embedding(drafter, target)
        with torch.no_grad():
            ids = build_draft_vocab(masked, dcfg.draft_vocab_size, every, target.eos_token_ids)
            drafter.set_vocab_mapping(ids)
            # Start the output head where the target's is: same final norm, same rows.
            drafter.lm_head.weight.copy_(target.lm_head().weight[ids.to(target.device)].float().cpu())
            norm = target.final_norm()
            if norm is not None and norm.weight.shape == drafter.norm.weight.shape:
                drafter.norm.weight.copy_(norm.weight.float().cpu())
        info["init_layer"] = start_layer(drafter, target, cfg.init_layer, cfg.init_embed_half)
        info["vocab"] = f"built from {int(masked.sum())} assistant tokens"
    info["vocab_coverage"] = coverage(masked, drafter.draft_to_target.cpu())
    return drafter, info


def start_layer(drafter: Eagle3Drafter, target, choice: str | int, embed_half: str = "zero") -> str:
    """Apply `TrainConfig.init_layer`; returns what the drafter's layer started from.

    "auto" takes the target layer that reads the top aux state (it starts closer to what the
    drafter must compute than a random layer, and ends with higher acceptance;
    benchmarks/drafter_recipes.py), and a random layer where the target's layers have another
    shape (MLA, MoE).
    """
    if choice in (None, "none"):
        return "random"
    if choice == "auto":
        index = min(target.aux_layer_ids[-1], target.num_layers - 1)
        try:
            return init_layer_from_target(drafter, target, index, embed_half)
        except SpecdecError as e:
            return f"random (target layer {index} does not fit: {e})"
    return init_layer_from_target(drafter, target, int(choice), embed_half)


@torch.no_grad()
def init_layer_from_target(drafter: Eagle3Drafter, target, index: int, embed_half: str = "zero") -> str:
    """Start the drafter's one layer as the target's decoder layer `index`, reading the top aux state.

    fc passes the highest aux state through unchanged, and the attention's hidden-state columns,
    o_proj, the MLP and the norms are the target layer's, so with index = the top aux id the
    drafter starts as exactly the computation the target does next. The columns that read the next
    token's embedding start at zero ("zero") or as a second copy ("copy"): they are what the drafter
    must learn, since the target never reads a token one position ahead. An MLP of another width
    (--intermediate-size) stays random.
    """
    if not -target.num_layers <= index < target.num_layers:
        raise SpecdecError(f"--init-layer {index}: the target has {target.num_layers} decoder layers; "
                           f"give 0..{target.num_layers - 1} or a negative index (-1 = the last)")
    src = target.layers[index]
    mid, h, tH = drafter.midlayer, drafter.cfg.hidden_size, drafter.cfg.target_hidden_size
    attn, sattn = mid.self_attn, getattr(src, "self_attn", None)
    weights = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w = getattr(getattr(sattn, name, None), "weight", None)
        want = getattr(attn, name).weight.shape
        want = want if name == "o_proj" else (want[0], want[1] // 2)
        if w is None or tuple(w.shape) != tuple(want) or h != tH:
            found = "missing" if w is None else tuple(w.shape)
            raise SpecdecError(f"{name} of target layer {index} is {found}; the drafter needs {tuple(want)}")
        weights[name] = w.float().cpu()
    norms = {}
    for name in ("input_layernorm", "post_attention_layernorm"):
        w = getattr(getattr(src, name, None), "weight", None)
        if w is None or tuple(w.shape) != (h,):
            raise SpecdecError(f"{name} of target layer {index} is {'missing' if w is None else tuple(w.shape)}; "
                               f"the drafter needs ({h},)")
        norms[name] = w.float().cpu()
    # Everything checked: from here on the drafter is written.
    for name in ("q_proj", "k_proj", "v_proj"):
        dst = getattr(attn, name).weight
        dst[:, h:] = weights[name]
        dst[:, :h] = weights[name] if embed_half == "copy" else 0.0
    attn.o_proj.weight.copy_(weights["o_proj"])
    for norm in (mid.hidden_norm, mid.input_layernorm):
        norm.weight.copy_(norms["input_layernorm"])
    mid.post_attention_layernorm.weight.copy_(norms["post_attention_layernorm"])
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -tH:] = torch.eye(h, tH)  # aux states come in canonical (ascending) order
    theirs, ours = getattr(src, "mlp", nn.Module()).state_dict(), mid.mlp.state_dict()
    if theirs.keys() == ours.keys() and all(theirs[k].shape == ours[k].shape for k in ours):
        mid.mlp.load_state_dict({k: v.float().cpu() for k, v in theirs.items()})
        return f"target layer {index}"
    return f"target layer {index} (attention and norms; the MLP's shape differs, random)"


def _latest_checkpoint(out: Path) -> Path | None:
    ck = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    ck = [c for c in ck if (c / "state.json").exists()]
    return ck[-1] if ck else None


def save_checkpoint(out: Path, step: int, model: Eagle3Drafter, opt, sched, state: dict, keep: int) -> Path:
    from safetensors.torch import save_file

    final = out / "checkpoints" / f"step-{step}"
    tmp = out / "checkpoints" / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Not the frozen embedding: it is the target's (113 MB of a SmolLM2 checkpoint's 180 MB in
    # fp32, 2.1 GB for a Llama-3-8B target's vocab), and a resume copies it from the target again.
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k != FROZEN}
    save_file(weights, str(tmp / "drafter.safetensors"))
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp / "optimizer.pt")
    write_json(tmp / "drafter_config.json", model.cfg.to_dict())
    write_json(tmp / "state.json", state)  # last: its presence marks a complete checkpoint
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        f.chmod(plain_mode())  # safetensors writes 0600
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    old = sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-keep]
    for o in old:
        shutil.rmtree(o, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: Eagle3Drafter, opt, sched) -> dict:
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(str(path / "drafter.safetensors")), strict=False)
    if unexpected or set(missing) - {FROZEN}:
        raise SpecdecError(f"checkpoint {path} does not match the drafter: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}; start again without --resume or pick the right --out")
    # Our own file, still read without unpickling arbitrary objects.
    st = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    return json.loads((path / "state.json").read_text())


def _to(samples, device, dtype):
    b = Batch.collate(samples, device)
    return b.input_ids, b.loss_mask, b.aux_hidden.to(dtype), b.last_hidden, b.valid, b.target_argmax


def step_batches(step: int, total: int, indices: list[int], lengths: list[int], batch_tokens: int, *, seed: int):
    """The global batch of every optimizer step from `step` to `total`, across epochs."""
    epoch, pos, batches = batches_at(step, indices, lengths, batch_tokens, seed=seed)
    for _ in range(step, total):
        if pos >= len(batches):
            epoch, pos = epoch + 1, 0
            batches = global_batches(indices, lengths, batch_tokens, seed=seed, epoch=epoch)
        yield batches[pos]
        pos += 1


class Prefetch:
    """`load(item)` for the items ahead of the one in use, in a worker thread on its own CUDA stream.

    A small drafter's step is short: reading its samples from disk, padding them, the first epoch's
    target argmax and the copy to the GPU would otherwise leave the device idle for much of each
    step. The consumer's stream waits on an event recorded after each load, so kernels never read a
    batch before its copy ends. Without CUDA the loads run inline: a CPU's cores are the compute.
    """

    def __init__(self, load, items, device: torch.device, ahead: int = 2):
        self.load, self.items, self.ahead = load, iter(items), ahead
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pool = None
        if self.cuda:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(1, thread_name_prefix="specdec-prefetch")

    def _load_on_stream(self, item):
        with torch.cuda.stream(self.stream):
            out = self.load(item)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def __iter__(self):
        if not self.cuda:
            yield from (self.load(item) for item in self.items)
            return
        queue = []
        try:
            while True:
                while len(queue) < self.ahead:
                    item = next(self.items, None)
                    if item is None:
                        break
                    queue.append(self.pool.submit(self._load_on_stream, item))
                if not queue:
                    return
                out, done = queue.pop(0).result()
                current = torch.cuda.current_stream()
                current.wait_event(done)
                for t in _tensors(out):
                    t.record_stream(current)  # its memory came from the worker's stream
                yield out
        finally:
            for f in queue:
                f.cancel()
            self.pool.shutdown(wait=True)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)


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
          target_name: str = "target", progress: bool = True) -> dict:
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
    ckpt = _latest_checkpoint(out)
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
    module = DrafterTTT(drafter, head, cfg.ttt_steps, cfg.ttt_decay, cfg.feature_loss).to(device)
    argmax_cache = TargetArgmaxCache(source, head, device)
    wrapped = module
    if world > 1:
        wrapped = nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if cuda else None)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=cuda)
    per_epoch = len(global_batches(train_idx, source.lengths, cfg.batch_tokens, seed=cfg.seed, epoch=0))
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
    log(f"specdec train: {len(train_idx)} train / {len(heldout)} held-out samples, {per_epoch} batches/epoch, "
        f"{total} steps, world size {world}, draft vocab {drafter.cfg.draft_vocab_size} "
        f"(covers {info['vocab_coverage']:.1%} of assistant tokens; {info['vocab']})")

    from ..progress import progress_bar

    bar = progress_bar("stats", label="train", enabled=progress and rank == 0)
    task = bar.add_task("train", total=total, completed=step, stats="")
    tokens_seen, t0 = 0, time.perf_counter()
    last_eval: dict = history[-1] if history else {}

    def load(gb):
        samples = argmax_cache.get(gb[rank::world] or gb[:1])
        return sum(len(s["input_ids"]) for s in samples), _to(samples, device, dtype)

    def show(done):
        """A finished step's figures, read while the next step is already queued on a GPU."""
        at, loss, correct0, counted, gnorm, lr = done
        loss, counted = loss.item(), float(counted)
        acc0 = float(correct0) / counted if counted else 0.0
        rate = tokens_seen / max(1e-9, time.perf_counter() - t0)
        bar.update(task, completed=at, stats=f"loss {loss:.3f} acc0 {acc0:.2f} {rate:,.0f} tok/s")
        if tb is not None:
            tb.add_scalar("train/loss", loss, at)
            tb.add_scalar("train/lr", lr, at)
            tb.add_scalar("train/grad_norm", float(gnorm), at)
            tb.add_scalar("train/tokens_per_s", rate, at)

    # A resume may start mid-epoch: step_batches locates the step, then walks the epochs forward.
    schedule = step_batches(step, total, train_idx, source.lengths, cfg.batch_tokens, seed=cfg.seed)
    pending = None
    with bar:
        for n_tokens, inputs in Prefetch(load, schedule, device):
            with autocast():
                loss, correct, _, counted = wrapped(*inputs)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            tokens_seen += n_tokens * world
            if pending is not None:
                show(pending)
            pending = (step, loss.detach(), correct[0], counted, gnorm, sched.get_last_lr()[0])
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
                save_checkpoint(out, step, drafter, opt, sched,
                                {"step": step, "total": total, "history": history, "config": asdict(cfg)},
                                cfg.keep_checkpoints)
        if pending is not None:
            show(pending)
    if world > 1:
        dist.barrier()
    summary = {"steps": step, "tokens_per_s": tokens_seen / max(1e-9, time.perf_counter() - t0),
               "eval": last_eval, "matmul_dtype": dtype_name(dtype), **info}
    if rank == 0:
        from ..models.formats import save_drafter

        drafter.cfg.provenance = provenance(target, source, drafter, last_eval)
        save_drafter(drafter, out / "drafter", "eagle3", target_name=target_name, dtype=torch.float32)
        write_json(out / "train_summary.json", summary)
        if tb is not None:
            tb.close()
    return summary
