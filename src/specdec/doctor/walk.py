"""Hypotheses measured on the reference's own text instead of by generating it again.

Greedy speculative decoding is lossless: whatever the drafter is fed, the engine emits the target's
greedy text, so a hypothesis changes only which drafts get accepted along that one text. The
reference run (the drafter as configured, in specdec's engine) writes the text once; one target
pass over it captures every layer a hypothesis may read (the configured ids and their neighbours);
each hypothesis is then the drafter's chain unrolled over the text (`ttt_unroll_states`, the
training unroll: k passes of one layer) and walked as the engine walks it (`walk_steps`). That is
the engine's own measurement of each switch, without a target pass per draft step
(tests/test_doctor.py checks it equals the engine, switch by switch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..train.ttt import ttt_unroll_states, walk_steps


@dataclass
class Text:
    """One prompt with the reference's answer and the target's states along it."""

    ids: torch.Tensor  # [L] prompt + answer
    prompt_len: int
    states: dict[int, torch.Tensor]  # canonical id -> [L, tH], the last layer's before the final norm


@dataclass
class Walk:
    """The engine's steps on one text: drafts accepted per step, and the chain depth every
    position would get (the paired comparison's unit: the same positions under every switch)."""

    accepted: list[int]
    depth: list[int]


def neighbour_ids(target, drafter) -> list[int]:
    """The ids any hypothesis may read: the configured ones and one layer either side."""
    return sorted({i + d for i in drafter.cfg.aux_layer_ids for d in (-1, 0, 1) if 0 <= i + d <= target.num_layers})


@torch.no_grad()
def capture_text(target, prompt: list[int], answer: list[int], ids: list[int]) -> Text:
    """One target pass over prompt + answer, keeping the states at `ids` (canonical)."""
    kept = (target.aux_layer_ids, target.last_state)
    target.aux_layer_ids, target.last_state = list(ids), "pre_norm"
    try:
        seq = torch.tensor(prompt + answer, dtype=torch.long, device=target.device)
        aux = target.forward(seq[None]).aux_hidden[0]
    finally:
        target.aux_layer_ids, target.last_state = kept
    return Text(seq, len(prompt), dict(zip(ids, aux.chunk(len(ids), -1))))


@torch.no_grad()
def walk_text(target, drafter, text: Text, k: int) -> Walk:
    """The engine's chain-of-k steps over `text` with the drafter and target as switched now."""
    ids = text.ids
    L, start = len(ids), text.prompt_len - 1  # the first step drafts from the prompt's last position
    aux = torch.cat([target.aux_state(i, text.states[i]) for i in drafter.cfg.aux_layer_ids], -1)
    aux = aux.to(device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
    to_target = drafter.draft_to_target
    depth = torch.zeros(max(0, L - 2 - start), dtype=torch.long)
    alive = None
    for s, (logits, _) in enumerate(ttt_unroll_states(drafter, ids[None].to(aux.device), aux[None], k,
                                                      logits_from=start)):
        n = L - 2 - s - start  # index start + j of step s predicts the token at start + j + 2 + s
        if n <= 0:
            break
        right = (to_target[logits[0, :n].argmax(-1)] == ids[start + 2 + s: start + 2 + s + n].to(aux.device)).cpu()
        alive = right if s == 0 else alive[:n] & right
        depth[:n] += alive
    full = [0] * start + depth.tolist() + [0] * (L - start - len(depth))
    starts = [False] * max(0, start - 1) + [True] * (len(full) - max(0, start - 1) - 2) + [False] * 2
    return Walk(walk_steps(full, starts, k), depth.clamp(max=k).tolist())


def summary(walks: list[Walk], k: int) -> dict:
    """The counters the engine reports, summed over texts (the keys `evaluate.summarize` uses)."""
    steps = [a for w in walks for a in w.accepted]
    n = len(steps)
    per_pos = [sum(a > i for a in steps) for i in range(k)]
    return {"k": k, "num_drafts": n, "mean_acceptance_length": 1 + sum(steps) / n if n else 1.0,
            "per_position_acceptance": [c / n if n else 0.0 for c in per_pos], "accepted_per_position": per_pos}
