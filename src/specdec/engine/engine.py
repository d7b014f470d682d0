"""The reference speculative engine: batch 1, any HF target, lossless.

Each step runs the target once over [last committed token, *draft], with a tree attention mask
when the draft branches, accepts the longest agreeing path (greedy) or applies recursive
rejection sampling (temperature > 0), rolls both KV caches back to what was accepted and commits
the bonus token. Plain decoding is the same step with an empty draft, so every mode shares one
verification path.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch
from transformers import DynamicCache

from ..errors import SpecdecError
from ..models.target import Target
from .api import GenerationResult, SamplingParams, StepOutput
from .eagle import Eagle3Proposer
from .ngram import NgramProposer
from .sampling import accept_among_children, sample, target_probs
from .tree import Draft, TreeConfig, verify_mask


class SpeculativeEngine:
    def __init__(
        self,
        target: Target,
        *,
        drafter=None,
        ngram: int | None = None,
        k: int = 5,
        tree: TreeConfig | None = None,
        proposer=None,
    ):
        """`proposer`: any object with `reset(prompt_ids)` and `propose(context, k) -> Draft`
        (context-based drafting such as n-gram lookup); used instead of drafter/ngram."""
        if drafter is not None and ngram:
            raise SpecdecError("choose one drafter: an EAGLE-3 drafter (--drafter) or n-gram lookup (--ngram)")
        self.target = target
        self.k = k
        self.tree = tree
        self.proposer = proposer
        if drafter is not None:
            self.proposer = Eagle3Proposer(drafter, k=k, tree=tree)
            if list(drafter.cfg.aux_layer_ids) != list(target.aux_layer_ids):
                target.set_aux_layer_ids(drafter.cfg.aux_layer_ids)
        elif ngram:
            self.proposer = NgramProposer(max_ngram=ngram, k=k)
        self.max_len = getattr(target.config, "max_position_embeddings", None) or 1 << 30

    @property
    def mode(self) -> str:
        if self.proposer is None:
            return "plain"
        if isinstance(self.proposer, NgramProposer):
            return "ngram"
        return "eagle3-tree" if self.tree else "eagle3-chain"

    def _forward(self, ids, cache, positions=None, mask=None, capture=False):
        return self.target.forward(
            ids, past_key_values=cache, position_ids=positions, attention_mask=mask, capture=capture
        )

    def _pick(self, logits: torch.Tensor, params: SamplingParams, gen) -> int:
        if params.temperature <= 0:
            return int(logits.argmax())
        return sample(target_probs(logits, params), gen)

    # How a too-long request is explained; the fast engine's limit is its static cache.
    _context_name = "the target's context"
    _context_hint = ""

    def _begin(self, prompt_ids: list[int], params: SamplingParams):
        """Check a request and return (sampling generator or None, stop token ids)."""
        if not prompt_ids:
            raise SpecdecError("empty prompt: expected at least one token")
        if len(prompt_ids) + params.max_new_tokens > self.max_len:
            raise SpecdecError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {params.max_new_tokens} exceeds "
                f"{self._context_name} of {self.max_len} tokens{self._context_hint}"
            )
        gen = None
        if params.temperature > 0:
            gen = torch.Generator(device=self.target.device)
            gen.manual_seed(params.seed if params.seed is not None else int(torch.seed() % (1 << 62)))
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.target.eos_token_ids))
        return gen, stops

    @torch.no_grad()
    def generate_iter(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        gen, stops = self._begin(prompt_ids, params)
        dev = self.target.device
        eagle = isinstance(self.proposer, Eagle3Proposer)
        cache = DynamicCache()
        ids = torch.tensor([prompt_ids], device=dev)
        out = self._forward(ids, cache, capture=eagle)
        last = self._pick(out.logits[0, -1], params, gen)
        context = list(prompt_ids) + [last]
        if eagle:
            self.proposer.reset(len(prompt_ids) + params.max_new_tokens + 64)
            self.proposer.commit(out.aux_hidden, torch.tensor(context[1:], device=dev))
        elif self.proposer is not None:
            self.proposer.reset(prompt_ids)
        produced = 1
        finished = last in stops or produced >= params.max_new_tokens
        yield StepOutput(token_ids=[last], finished=finished,
                         finish_reason=("stop" if last in stops else "length") if finished else None)
        while not finished:
            P = len(context) - 1  # tokens in the target cache; context[-1] is not yet in it
            budget = params.max_new_tokens - produced
            if eagle:
                draft = self.proposer.propose(params, gen, self.target.vocab_size)
            elif self.proposer is not None:
                draft = self.proposer.propose(context, min(self.k, budget))
            else:
                draft = Draft()
            n = len(draft)
            inp = torch.tensor([[context[-1], *draft.tokens]], device=dev)
            if n and not draft.is_chain:
                depths = draft.depths()
                positions = torch.tensor([[P] + [P + 1 + d for d in depths]], device=dev)
                mask = verify_mask(draft.parents, P, self.target.dtype, dev)
            else:
                positions = torch.arange(P, P + 1 + n, device=dev)[None]
                mask = None
            out = self._forward(inp, cache, positions, mask, capture=eagle)
            logits = out.logits[0]  # shape: [1 + n, V]
            path, bonus = self._accept(draft, logits, params, gen)
            # Roll the target cache back to [.., last, *accepted path].
            if path and path != list(range(len(path))):
                _compact(cache, P + 1, [P + 1 + i for i in path])
            _crop(cache, P + 1 + len(path))
            new_tokens = [draft.tokens[i] for i in path] + [bonus]
            if eagle:
                rows = torch.tensor([0] + [1 + i for i in path], device=dev)
                self.proposer.commit(out.aux_hidden[:, rows], torch.tensor(new_tokens, device=dev))
            out = step_output(new_tokens, len(path), max(draft.depths(), default=-1) + 1, n, context, produced,
                              params.max_new_tokens, stops)
            produced += len(out.token_ids)
            finished = out.finished
            yield out

    def _accept(self, draft: Draft, logits: torch.Tensor, params: SamplingParams, gen) -> tuple[list[int], int]:
        """Walk the draft from the root; returns (accepted node indices, bonus token)."""
        children = draft.children()
        path: list[int] = []
        node = -1
        while True:
            row = logits[0 if node < 0 else 1 + node]
            kids = children.get(node, [])
            if params.temperature <= 0:
                best = int(row.argmax())
                match = next((c for c in kids if draft.tokens[c] == best), None)
                if match is None:
                    return path, best
                path.append(match)
                node = match
                continue
            p = target_probs(row, params)
            q = draft.q.get(node) if draft.q is not None else None
            idx, residual = accept_among_children(p, [draft.tokens[c] for c in kids], q, gen)
            if idx is None:
                return path, sample(residual, gen)
            node = kids[idx]
            path.append(node)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        t0 = time.perf_counter()
        tokens: list[int] = []
        steps = drafts = drafted = accepted = 0
        per_pos: list[int] = []
        reason = "length"
        for step in self.generate_iter(prompt_ids, params):
            tokens.extend(step.token_ids)
            steps += 1
            if step.drafted:
                drafts += 1
                drafted += step.drafted
                accepted += step.accepted
                if len(per_pos) < len(step.accepted_positions):
                    per_pos += [0] * (len(step.accepted_positions) - len(per_pos))
                for i, ok in enumerate(step.accepted_positions):
                    per_pos[i] += int(ok)
            if step.finished:
                reason = step.finish_reason or reason
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        return GenerationResult(
            prompt_tokens=len(prompt_ids), token_ids=tokens, seconds=time.perf_counter() - t0,
            num_steps=steps, num_drafts=drafts, drafted=drafted, accepted=accepted,
            accepted_per_position=per_pos, finish_reason=reason,
        )


def step_output(new_tokens: list[int], accepted: int, depths: int, drafted: int, context: list[int], produced: int,
                max_new_tokens: int, stops: set[int]) -> StepOutput:
    """What a step that accepted `accepted` of `drafted` drafts (over `depths` draft positions)
    emits: its new tokens cut at a stop token or the length budget (`truncate_at_stop`), which are
    appended to `context`. Every engine's loop ends its steps here."""
    committed, reason = truncate_at_stop(new_tokens, stops, produced, max_new_tokens)
    context.extend(committed)
    return StepOutput(token_ids=committed, drafted=drafted, accepted=accepted,
                      accepted_positions=[i < accepted for i in range(depths)], finished=reason is not None,
                      finish_reason=reason)


def truncate_at_stop(new_tokens: list[int], stops: set[int], produced: int, max_new_tokens: int):
    """The tokens of one step that are actually emitted: up to and including the first stop
    token, and no more than the length budget. Returns (tokens, finish reason or None)."""
    committed: list[int] = []
    for t in new_tokens:
        committed.append(t)
        if t in stops:
            return committed, "stop"
        if produced + len(committed) >= max_new_tokens:
            return committed, "length"
    return committed, None


def _crop(cache, keep: int) -> None:
    # A negative argument ("remove this many") means the same in every transformers 5.x.
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def _compact(cache, dst_start: int, src: list[int]) -> None:
    """Move cache entries at `src` to dst_start.. in every layer (tree path -> contiguous)."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is None or t.dim() < 3:
                continue
            idx = torch.tensor(src, device=t.device)
            t[:, :, dst_start : dst_start + len(src)] = t.index_select(2, idx)
