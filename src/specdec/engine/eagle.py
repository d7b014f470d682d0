"""EAGLE-3 drafting: the drafter keeps its own KV cache over committed positions, proposes a chain
or an EAGLE-2-style dynamic tree, and is rolled back and extended with what the target accepted.

Index convention (same as training): drafter position t reads the target states at t and the
token at t+1, and predicts the token at t+2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.drafter import Eagle3Drafter
from .api import SamplingParams
from .sampling import gumbel_topk
from .tree import Draft, TreeConfig


class Eagle3Proposer:
    """The eager EAGLE-3 proposer (`engine.Proposer`): any drafter, chains and trees, greedy or sampled."""

    needs_aux = True

    def __init__(self, drafter: Eagle3Drafter, *, k: int = 5, tree: TreeConfig | None = None):
        self.drafter = drafter
        self.k = k
        self.tree = tree
        self.cache = None
        self.last_hidden = None  # shape: [H], recycled hidden at the last committed position
        self.last_logits = None  # shape: [draft_vocab]
        self.d2t_ids = drafter.draft_to_target
        self.vocab = drafter.cfg.vocab_size  # the target's: a sampled draft's q spans it

    @property
    def length(self) -> int:
        return self.cache.length

    def begin(self, prompt_ids: list[int], context: list[int], aux: torch.Tensor, max_len: int) -> None:
        """A new request: a cache of `max_len` positions, then the prompt's positions committed."""
        self.cache = self.drafter.new_cache(1, max_len)
        self.commit(aux, torch.tensor(context[1:], device=aux.device))

    @torch.no_grad()
    def commit(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Extend over committed positions. aux: [m, 3*tH]; next_tokens: [m] (token at t+1)."""
        start = self.cache.length
        m = next_tokens.numel()
        pos = torch.arange(start, start + m, device=aux.device)[None]
        dt = self.drafter.lm_head.weight.dtype
        hidden, logits = self.drafter(next_tokens[None], aux[None].to(dt), pos, self.cache)
        self.last_hidden, self.last_logits = hidden[0, -1], logits[0, -1]

    def _full_q(self, probs_draft: torch.Tensor, vocab: int) -> torch.Tensor:
        q = torch.zeros(vocab, dtype=torch.float32, device=probs_draft.device)
        q[self.d2t_ids] = probs_draft.float()
        return q

    @torch.no_grad()
    def propose(self, context: list[int], limit: int, params: SamplingParams, gen: torch.Generator | None) -> Draft:
        """k drafts deep (a chain or the tree's shape) from the last committed position."""
        vocab = self.vocab
        chain = self.tree is None
        width = 1 if chain else self.tree.top_k
        depth = self.k if chain else self.tree.depth
        sampling = params.temperature > 0
        base = self.cache.length
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        slots: dict[int, int] = {}  # node -> drafter cache slot once fed
        hidden_of = {-1: self.last_hidden}
        logits_of = {-1: self.last_logits}
        q: dict[int, torch.Tensor] | None = {} if sampling else None
        frontier = [-1]
        for d in range(depth):
            new = []
            for f in frontier:
                lg = logits_of[f].float()
                if sampling:
                    log_q = F.log_softmax(lg / params.temperature, -1)
                    kids = gumbel_topk(log_q, width, gen).tolist()
                    q[f] = self._full_q(log_q.exp(), vocab)
                else:
                    log_q = F.log_softmax(lg, -1)
                    kids = log_q.topk(width).indices.tolist()
                parent_score = scores[f] if f >= 0 else 0.0
                for c in kids:
                    tokens.append(int(self.d2t_ids[c]))
                    parents.append(f)
                    scores.append(parent_score + float(log_q[c]))
                    new.append(len(tokens) - 1)
            if d == depth - 1:
                break
            if chain or sampling:
                # Sampling trees keep a fixed shape (expand the first-drawn child) so that the
                # children of every node stay a without-replacement sample: lossless.
                frontier = [new[0]] if chain else [n for n in new if n == new[0]]
            else:
                frontier = sorted(new, key=lambda n: -scores[n])[:width]
            self._feed(frontier, parents, tokens, slots, hidden_of, logits_of, base + d)
        self.cache.crop(base)
        if not chain and not sampling and len(tokens) > self.tree.total_tokens:
            tokens, parents, q = _select(tokens, parents, scores, self.tree.total_tokens, q)
        return Draft(tokens=tokens, parents=parents, q=q)

    def _feed(self, nodes, parents, tokens, slots, hidden_of, logits_of, position):
        dev = self.last_hidden.device
        n = len(nodes)
        past = self.cache.length
        base = past - len(slots)  # committed length
        mask = torch.zeros(n, past + n, dtype=torch.bool, device=dev)
        mask[:, :base] = True
        for r, node in enumerate(nodes):
            mask[r, past + r] = True
            a = parents[node]
            while a >= 0:
                mask[r, slots[a]] = True
                a = parents[a]
        ids = torch.tensor([[tokens[x] for x in nodes]], device=dev)
        hid = torch.stack([hidden_of[parents[x]] for x in nodes])[None]
        pos = torch.full((1, n), position, device=dev)
        h, lg = self.drafter(ids, hid, pos, self.cache, mask)
        for r, node in enumerate(nodes):
            slots[node] = past + r
            hidden_of[node], logits_of[node] = h[0, r], lg[0, r]


def _select(tokens, parents, scores, n, q):
    """Keep the n best-scoring nodes such that every kept node's parent is kept (EAGLE-2)."""
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
    kept: list[int] = []
    keep_set: set[int] = set()
    changed = True
    while len(kept) < n and changed:
        changed = False
        for i in order:
            if i not in keep_set and (parents[i] < 0 or parents[i] in keep_set):
                kept.append(i)
                keep_set.add(i)
                changed = True
                break
    kept.sort()  # parents precede children in creation order
    new_index = {old: new for new, old in enumerate(kept)}
    return (
        [tokens[i] for i in kept],
        [new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept],
        q,
    )
