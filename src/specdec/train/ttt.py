"""Training-time test: unroll the drafter N steps over a batch of captured sequences.

Index t of step s reads the token at t+1+s (teacher forcing) and, for s > 0, the drafter's own
hidden output of step s-1 at t; it sits at position t+s and predicts the token at t+2+s, whose
target distribution is the target model's next-token distribution from last_hidden[t+1+s],
restricted to the draft vocab. Positions where the target's argmax falls outside the draft vocab
carry no loss. Step s is weighted by decay**s.

An optional feature loss (EAGLE-1's, off by default as in EAGLE-3) also pulls the drafter's normed
output at t toward the target's normed final state at t+1+s, the vector the target's lm_head reads:
a dense signal per token where the cross-entropy gives one label, which matters when data is scarce.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..models.drafter import Eagle3Drafter, ttt_attention


@dataclass
class TargetHead:
    """The target's final norm and lm_head: turns captured last_hidden into target logits."""

    norm_weight: torch.Tensor  # [H]
    norm_eps: float
    lm_head: torch.Tensor  # [V, H]

    @classmethod
    def from_target(cls, target) -> "TargetHead":
        norm = target.final_norm()
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        return cls(norm.weight.detach().float().cpu(), float(eps), target.lm_head().weight.detach().float().cpu())

    def to(self, device) -> "TargetHead":
        return TargetHead(self.norm_weight.to(device), self.norm_eps, self.lm_head.to(device))

    def normed(self, last_hidden: torch.Tensor) -> torch.Tensor:
        x = last_hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return x * self.norm_weight


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] int64
    loss_mask: torch.Tensor  # [B, L] bool
    aux_hidden: torch.Tensor  # [B, L, 3*tH]
    last_hidden: torch.Tensor  # [B, L, H]
    valid: torch.Tensor  # [B, L] bool, real (non-pad) tokens
    target_argmax: torch.Tensor | None = None  # [B, L] int64, -1 = not known (see TargetArgmaxCache)

    @classmethod
    def collate(cls, samples: list[dict], device, shape: tuple[int, int] | None = None) -> "Batch":
        """Pad and stack on the host, then copy to `device`; to a GPU from pinned memory without
        blocking (the copy is ordered on the current stream like any kernel). `shape` (rows,
        length): pad to it, with rows of padding only, where it is larger than the samples'."""
        B, L = len(samples), max(len(s["input_ids"]) for s in samples)
        if shape is not None:
            B, L = max(B, shape[0]), max(L, shape[1])
        d_aux = samples[0]["aux_hidden"].shape[-1]
        d_last = samples[0]["last_hidden"].shape[-1]
        dt = samples[0]["aux_hidden"].dtype
        pin = torch.device(device).type == "cuda"
        ids = torch.zeros(B, L, dtype=torch.long, pin_memory=pin)
        mask = torch.zeros(B, L, dtype=torch.bool, pin_memory=pin)
        valid = torch.zeros(B, L, dtype=torch.bool, pin_memory=pin)
        aux = torch.zeros(B, L, d_aux, dtype=dt, pin_memory=pin)
        last = torch.zeros(B, L, d_last, dtype=dt, pin_memory=pin)
        known = all("target_argmax" in s for s in samples)
        top = torch.full((B, L), -1, dtype=torch.long, pin_memory=pin) if known else None
        for b, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[b, :n] = torch.as_tensor(s["input_ids"]).long()
            mask[b, :n] = torch.as_tensor(s["loss_mask"]).bool()
            valid[b, :n] = True
            aux[b, :n] = s["aux_hidden"]
            last[b, :n] = s["last_hidden"]
            if known:
                top[b, :n] = s["target_argmax"].long()

        def move(t):
            return t.to(device, non_blocking=pin)

        return cls(move(ids), move(mask), move(aux), move(last), move(valid), move(top) if known else None)


@torch.no_grad()
def target_argmax(head: TargetHead, last_hidden: torch.Tensor, rows: torch.Tensor | None = None,
                  chunk: int = 1024) -> torch.Tensor:
    """The target's full-vocab argmax [B, L] (int64) where `rows` [B, L] is set, -1 elsewhere.

    This [*, H] x [H, V] product is the costliest part of a small drafter's training step (about a
    third of it for SmolLM2 on a CPU), so training computes it once per sample and caches it.
    """
    return _argmax_of_normed(head, head.normed(last_hidden), rows, chunk)


def _argmax_of_normed(head: TargetHead, normed: torch.Tensor, rows: torch.Tensor | None, chunk: int = 1024):
    out = torch.full(normed.shape[:2], -1, dtype=torch.long, device=normed.device)
    where = rows.nonzero(as_tuple=True) if rows is not None else None
    flat = normed[where] if where is not None else normed.reshape(-1, normed.shape[-1])
    top = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for i in range(0, flat.shape[0], chunk):  # never a [B*L, V] matrix
        top[i : i + chunk] = (flat[i : i + chunk] @ head.lm_head.T).argmax(-1)
    if where is not None:
        out[where] = top
    else:
        out = top.view(normed.shape[:2])
    return out


@torch.no_grad()
def target_distribution(head: TargetHead, last_hidden: torch.Tensor, draft_ids: torch.Tensor,
                        t2d: torch.Tensor, rows: torch.Tensor | None = None,
                        argmax: torch.Tensor | None = None):
    """(log-probs over the draft vocab [B, L, Vd], target argmax is in the draft vocab [B, L]).

    The full-vocab argmax is taken from `argmax` when given, else computed where `rows` is set.
    """
    normed = head.normed(last_hidden)  # shape: [B, L, H]
    draft_logits = normed @ head.lm_head[draft_ids].T  # shape: [B, L, Vd]
    if argmax is None:
        argmax = _argmax_of_normed(head, normed, rows)
    in_vocab = (argmax >= 0) & t2d[argmax.clamp(min=0)]
    return F.log_softmax(draft_logits, -1), in_vocab


class TargetArgmaxCache:
    """Per-sample target argmax, computed the first time a sample is drawn and reused after."""

    def __init__(self, source, head: TargetHead, device):
        self.source, self.head, self.device = source, head, device
        self.lengths = source.lengths
        self.known: dict[int, torch.Tensor] = {}

    def get(self, indices: list[int], shape: tuple[int, int] | None = None) -> list[dict]:
        samples = self.source.get(indices, shape)
        new = {}
        for i, s in zip(indices, samples):
            if i not in self.known and i not in new:
                # Sample by sample, so a value never depends on which batch first drew the sample
                # (an exact --resume recomputes it in another batch); read back once per batch.
                rows = torch.as_tensor(s["loss_mask"]).bool().roll(-1, 0)[None].to(self.device)
                new[i] = target_argmax(self.head, s["last_hidden"][None].to(self.device), rows)[0].to(torch.int32)
        if new:
            host = torch.cat(list(new.values())).cpu().split([len(t) for t in new.values()])
            self.known.update(zip(new, host))
        for i, s in zip(indices, samples):
            s["target_argmax"] = self.known[i]
        return samples


def first_step(raw: Eagle3Drafter, ids, aux_hidden, positions, logits_from: int = 0):
    """Step 0: the layer over the target's states [B, L, 3tH], attending causally. Returns
    (logits [B, L - logits_from, Vd], the layer's output before the final norm [B, L, H], the
    hidden the next step reads, this step's keys and values [B, kvh, L, hd], which every later
    step attends to causally)."""
    kv = []

    def attend(q, k, v):
        kv.append((k, v))
        return ttt_attention(q, k, v)

    out = raw.layer(ids, raw.project_aux(aux_hidden.to(raw.fc.weight.dtype)), positions, attend)
    hidden, logits = raw.head(out, logits_from)
    (k, v), = kv
    return logits, out, hidden, k, v


def later_step(raw: Eagle3Drafter, ids, hidden, positions, k0, v0, step_k, step_v, slot, logits_from: int = 0):
    """Step s >= 1: the layer over the last step's hidden, attending to step 0's keys causally and
    to each step's key at the same position (ttt_attention). Its own key and value go into slot
    `slot` = s - 1 of `step_k` / `step_v` [B, kvh, L, steps - 1, hd]; `slot` is a 0-dim tensor,
    so every later step has the same shapes and, compiled, is one graph. Returns (logits, output,
    next hidden, step_k, step_v with this step's slot filled)."""
    kv = []

    def attend(q, k, v):
        slots = torch.arange(step_k.shape[3], device=k.device)
        here = (slots == slot)[:, None]  # shape: [S, 1], against [..., S, hd]
        # Contiguous, as the empty slots are: every later step then reads one layout.
        sk = torch.where(here, k.unsqueeze(-2), step_k).contiguous()
        sv = torch.where(here, v.unsqueeze(-2), step_v).contiguous()
        kv.append((sk, sv))
        return ttt_attention(q, k0, v0, sk, sv, slots <= slot)

    out = raw.layer(ids, hidden, positions, attend)
    hidden, logits = raw.head(out, logits_from)
    (sk, sv), = kv
    return logits, out, hidden, sk, sv


def soft_cross_entropy(logits: torch.Tensor, p_target: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Mean over the weighted positions of -sum(p_target * log_softmax(logits)): logits and
    p_target [B, n, Vd], weight [B, n]."""
    return weighted_mean(-(p_target * F.log_softmax(logits.float(), -1)).sum(-1), weight)


def weighted_mean(per_position: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The mean of a per-position loss [B, n] over the weighted positions (none weighted: 0)."""
    return (per_position * weight).sum() / weight.sum().clamp(min=1.0)


@dataclass(frozen=True)
class TTTSteps:
    """The pieces of the unroll that run once per TTT step, as one place to compile them: eager,
    a small drafter's step is thousands of small kernels launched from Python. Compiled (with
    symbolic sizes), each is one graph for every step and every batch shape, so the compiler
    sees one step rather than the whole unrolled loss, and compiles it once."""

    first: Callable = first_step
    later: Callable = later_step
    cross_entropy: Callable = soft_cross_entropy

    def compiled(self, **options) -> "TTTSteps":
        """These functions under `torch.compile(fn, **options)`, traced without duck sizing: it
        makes sizes that happen to be equal on the first call one symbol (a batch of as many rows
        as the drafter has key heads, a slice's offset equal to the vocab) and the next call that
        parts them compiles again."""
        from torch.fx.experimental import _config as shape_config

        def build(fn):
            compiled = torch.compile(fn, **options)

            @functools.wraps(fn)
            def run(*args):
                with shape_config.patch(use_duck_shape=False):
                    return compiled(*args)

            return run

        return TTTSteps(*(build(f) for f in (self.first, self.later, self.cross_entropy)))


EAGER = TTTSteps()


@dataclass
class TTTOutput:
    loss: torch.Tensor
    correct: torch.Tensor  # [steps] count of positions whose steps 0..s were all right
    step_correct: torch.Tensor  # [steps] count right at step s (teacher-forced)
    counted: torch.Tensor  # [] positions scored (step 0)
    depth: torch.Tensor | None = None  # [B, L] drafts a chain from t would get accepted (steps 0.. all right)
    starts: torch.Tensor | None = None  # [B, L] a step may draft from t (the token at t + 2 is scored)


def ttt_loss(drafter: Eagle3Drafter, batch: Batch, head: TargetHead, *, steps: int = 7,
             decay: float = 0.8, feature_weight: float = 0.0, walk: bool = False,
             fns: TTTSteps = EAGER) -> TTTOutput:
    """The TTT loss with the per-step accuracies used for the simulated acceptance length.
    `feature_weight` > 0 adds the feature loss (module docstring), relative squared error per token.
    With `walk`, also each position's accepted depth and whether a step may start there (for
    walk_acceptance; only evaluation asks). `fns`: the per-step functions (TTTSteps), eager by
    default or compiled."""
    raw = drafter.module if hasattr(drafter, "module") else drafter
    B, L = batch.input_ids.shape
    dev = batch.input_ids.device
    draft_ids = raw.draft_to_target
    # last_hidden[j-1] gives the distribution of token j; only assistant tokens j are scored.
    needed = batch.loss_mask.roll(-1, dims=1) & batch.valid
    logp_target, in_vocab = target_distribution(head, batch.last_hidden, draft_ids, raw.t2d, needed,
                                                batch.target_argmax)
    # Positions j = t + 2 + s whose token is an assistant token the draft vocab can express: the
    # loss covers these. The accuracies count every assistant token, those outside the draft vocab
    # as misses, as the engine does (counting only the expressible ones overstated acceptance by
    # the vocab's coverage at every position).
    eligible = batch.loss_mask & batch.valid
    scored = eligible & in_vocab.roll(1, dims=1)
    # Every step reads shifted views of these; nothing [B, L, Vd] is copied or zero-padded per step.
    p_target = logp_target.exp()
    top_target = logp_target.argmax(-1)  # shape: [B, L]
    loss = torch.zeros((), device=dev)
    correct, step_correct = [], []
    counted = torch.zeros((), device=dev)
    depth = torch.zeros(B, L, dtype=torch.long, device=dev) if walk else None
    base = torch.zeros_like(eligible)
    if feature_weight > 0:
        want = head.normed(batch.last_hidden)  # shape: [B, L, H]; scored where `needed`, as the CE
    for s, (logits, out) in enumerate(ttt_unroll_states(raw, batch.input_ids, batch.aux_hidden, steps, fns=fns)):
        n = L - 2 - s  # indices t < n have a target at t + 2 + s
        if n <= 0:
            correct.append(torch.zeros((), device=dev))
            step_correct.append(torch.zeros((), device=dev))
            continue
        m = scored[:, 2 + s : 2 + s + n]  # shape: [B, n]
        # Soft cross-entropy against the target's distribution from last_hidden[t+1+s].
        loss = loss + (decay**s) * fns.cross_entropy(logits[:, :n], p_target[:, 1 + s : 1 + s + n], m.float())
        if feature_weight > 0:
            fw = needed[:, 1 + s : 1 + s + n].float()
            tgt_h = want[:, 1 + s : 1 + s + n]
            err = (raw.norm(out[:, :n]).float() - tgt_h).pow(2).sum(-1) / tgt_h.pow(2).sum(-1).clamp(min=1e-6)
            loss = loss + feature_weight * (decay**s) * (err * fw).sum() / fw.sum().clamp(min=1.0)
        with torch.no_grad():
            right = (logits[:, :n].argmax(-1) == top_target[:, 1 + s : 1 + s + n]) & m  # shape: [B, n]
            if s == 0:
                base[:, :n] = eligible[:, 2 : 2 + n]
                counted = base.sum().float()
                alive = right
            else:
                # Chain acceptance as a greedy target would give it: every step <= s right.
                alive = alive[:, :n] & right
            correct.append((alive & base[:, :n]).sum().float())
            step_correct.append(right.sum().float())
            if walk:
                depth[:, :n] += alive & base[:, :n]
    return TTTOutput(loss, torch.stack(correct), torch.stack(step_correct), counted, depth, base if walk else None)


def walk_acceptance(depth: torch.Tensor, starts: torch.Tensor, k: int) -> tuple[int, int]:
    """(tokens, steps) of the engine's walk over teacher-forced text with chains of k: in each run
    of assistant tokens the first comes from the target's own pass over the prompt, then each step
    drafts from where the last one ended, commits its accepted drafts and the target's token, and
    the next starts after them. The per-position figures (`chain_acceptance`) average over every
    position; the engine meets a position after a miss more often than one inside a long accepted
    run, so where acceptance varies along the text their mean overstates what it measures, and
    tokens / steps here is what it measures on this text."""
    tokens = steps = 0
    for d, can in zip(depth.tolist(), starts.tolist()):
        accepted = walk_steps(d, can, k)
        steps += len(accepted)
        tokens += sum(accepted) + len(accepted)
    return tokens, steps


def walk_steps(depth: list[int], starts: list[bool], k: int) -> list[int]:
    """The drafts each step of `walk_acceptance`'s walk accepts, over one row."""
    accepted: list[int] = []
    t, L = 0, len(starts)
    while t < L:
        if not starts[t]:
            t += 1
            continue
        last = t  # the run's last start: the engine's step there commits the run's last token
        while last + 1 < L and starts[last + 1]:
            last += 1
        t += 1  # the run's first token: the target's, from the prompt
        while t <= last:
            # A step commits its accepted drafts and the target's token, and never past the run.
            a = min(depth[t], k, last - t)
            accepted.append(a)
            t += a + 1
    return accepted


def ttt_unroll(raw: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int):
    """Yield the draft-vocab logits [B, L, Vd] of steps 0..steps-1; index t of step s predicts the
    token at t+2+s (teacher forcing on `input_ids`, the drafter's own hidden states recycled)."""
    for logits, _ in ttt_unroll_states(raw, input_ids, aux_hidden, steps):
        yield logits


def ttt_unroll_states(raw: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int,
                      logits_from: int = 0, fns: TTTSteps = EAGER):
    """`ttt_unroll`, yielding (logits, the layer's output before the final norm [B, L, H]); the
    logits of indices logits_from.. only ([B, L - logits_from, Vd])."""
    B, L = input_ids.shape
    positions = torch.arange(L, device=input_ids.device)[None].expand(B, L)
    slots = torch.arange(max(steps - 1, 1), device=input_ids.device)
    for s in range(steps):
        ids = torch.zeros_like(input_ids)
        ids[:, : max(0, L - 1 - s)] = input_ids[:, 1 + s :]  # token at t+1+s; shape: [B, L]
        if s == 0:
            logits, out, hidden, k0, v0 = fns.first(raw, ids, aux_hidden, positions, logits_from)
            # Empty slots, marked as needing gradients when training, like every later step's
            # output: one kind of input for every later step (compiled, one graph).
            step_k = k0.new_zeros(*k0.shape[:3], steps - 1, k0.shape[3]).requires_grad_(k0.requires_grad)
            step_v = torch.zeros_like(step_k).requires_grad_(k0.requires_grad)  # shape: [B, kvh, L, S, hd]
        else:
            logits, out, hidden, step_k, step_v = fns.later(raw, ids, hidden, positions + s, k0, v0, step_k, step_v,
                                                            slots[s - 1], logits_from)
        yield logits, out
