"""The speculative step loop, written once: batch 1, lossless, over two small interfaces.

A proposer (`Proposer`: plain, n-gram, EAGLE-3 eager, EAGLE-3 static) drafts; a verifier
(`CacheVerifier` on Hugging Face's cache for any target here, the static decoder in `fast.py`)
runs the target once over [last committed token, *draft], with a tree attention mask when the
draft branches, and keeps the accepted path. `accept` takes the longest agreeing path (greedy) or
applies recursive rejection sampling (temperature > 0); the proposer commits what was accepted
and the bonus token. Plain decoding is the same step with an empty draft, so every mode shares one
verification path. `SpeculativeEngine` is the reference engine (the loop on `CacheVerifier`);
`fast.FastEngine` is the same loop on the static decoder, plus its one opt-in variant, greedy
steps advanced on the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
from transformers import DynamicCache

from ..errors import SpecdecError
from ..models.target import Target
from .api import GenerationResult, SamplingParams, StepOutput
from .eagle import Eagle3Proposer
from .ngram import NgramProposer
from .sampling import accept_among_children, sample, target_probs
from .tree import Draft, TreeConfig, verify_mask


class Proposer(Protocol):
    """What drafts for the step loop. `begin` starts a request (`aux`: the target's states over the
    prompt's positions [m, 3H] for proposers that read them, else None; `context` is the prompt
    and its first token); `propose` drafts at most `limit` tokens deep after `context`; `commit`
    takes what the target accepted (`aux`: the states at the accepted positions [m, 3H]).
    Implemented by `PlainProposer`, `NgramProposer`, `Eagle3Proposer` and the static drafters
    (`eagle_graph.py`); a custom one may be passed to `SpeculativeEngine(proposer=...)`."""

    needs_aux: bool

    def begin(self, prompt_ids: list[int], context: list[int], aux: torch.Tensor | None, max_len: int) -> None: ...

    def propose(self, context: list[int], limit: int, params: SamplingParams, gen) -> Draft: ...

    def commit(self, aux: torch.Tensor | None, new_tokens: torch.Tensor) -> None: ...


class PlainProposer:
    """No drafts: every step verifies only the last token, which is plain decoding."""

    needs_aux = False

    def begin(self, prompt_ids, context, aux, max_len) -> None:
        pass

    def propose(self, context, limit, params, gen) -> Draft:
        return Draft()

    def commit(self, aux, new_tokens) -> None:
        pass


@dataclass
class Rows:
    """What a verifier returns for the rows of one pass: [root, *draft nodes]."""

    logits: torch.Tensor | None  # [rows, V]
    top: torch.Tensor | list[int] | None = None  # [rows] argmax, where the verifier computes it
    aux: torch.Tensor | None = None  # [rows, 3H] target states, when captured


class CacheVerifier:
    """Prefill and verification on Hugging Face's DynamicCache: any causal LM the target wraps.
    A tree draft is verified under a tree attention mask; the accepted path is compacted and the
    rest cropped."""

    def __init__(self, target: Target):
        self.target = target
        self.cache = None

    def _forward(self, ids, positions=None, mask=None, capture=False):
        return self.target.forward(ids, past_key_values=self.cache, position_ids=positions, attention_mask=mask,
                                   capture=capture)

    def prefill(self, prompt_ids: list[int], capture: bool) -> Rows:
        self.cache = DynamicCache()
        out = self._forward(torch.tensor([prompt_ids], device=self.target.device), capture=capture)
        return Rows(out.logits[0, -1:], aux=out.aux_hidden[0] if capture else None)

    def verify(self, tokens: list[int], P: int, draft: Draft, capture: bool) -> Rows:
        dev = self.target.device
        inp = torch.tensor([tokens], device=dev)
        if len(draft) and not draft.is_chain:
            positions = torch.tensor([[P] + [P + 1 + d for d in draft.depths()]], device=dev)
            mask = verify_mask(draft.parents, P, self.target.dtype, dev)
        else:
            positions, mask = torch.arange(P, P + len(tokens), device=dev)[None], None
        out = self._forward(inp, positions, mask, capture=capture)
        return Rows(out.logits[0], aux=out.aux_hidden[0] if capture else None)

    def keep(self, P: int, path: list[int]) -> None:
        """Roll the cache back to [.., last, *accepted path]."""
        if path and path != list(range(len(path))):
            _compact(self.cache, P + 1, [P + 1 + i for i in path])
        _crop(self.cache, P + 1 + len(path))


def accept(draft: Draft, rows: Rows, params: SamplingParams, gen) -> tuple[list[int], int]:
    """Walk the draft from the root; returns (accepted node indices, bonus token). Greedy: the
    longest path whose every token is the target's argmax at its parent, the bonus the argmax
    after it. Sampling: recursive rejection sampling over each node's children (lossless)."""
    children = draft.children()
    path: list[int] = []
    node = -1
    if params.temperature <= 0:
        top = rows.top if isinstance(rows.top, list) else (
            rows.top if rows.top is not None else rows.logits.argmax(-1))[: len(draft) + 1].tolist()
        while True:
            best = top[0 if node < 0 else 1 + node]
            match = next((c for c in children.get(node, []) if draft.tokens[c] == best), None)
            if match is None:
                return path, best
            path.append(match)
            node = match
    while True:
        kids = children.get(node, [])
        p = target_probs(rows.logits[0 if node < 0 else 1 + node], params)
        q = draft.q.get(node) if draft.q is not None else None
        idx, residual = accept_among_children(p, [draft.tokens[c] for c in kids], q, gen)
        if idx is None:
            return path, sample(residual, gen)
        node = kids[idx]
        path.append(node)


PLAIN = PlainProposer()


class SpeculativeEngine:
    """The step loop (`generate_iter`) on a verifier and a proposer; see the module docstring."""

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
        """`proposer`: any `Proposer` (used instead of drafter/ngram), e.g. one drafting from the
        context alone."""
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

    def _verifier(self):
        return CacheVerifier(self.target)

    def _request_proposer(self, params: SamplingParams):
        return self.proposer if self.proposer is not None else PLAIN

    def _device_steps_for(self, proposer, context: list[int], produced: int, params: SamplingParams, stops):
        """The steps that run on the device instead of the loop below, or None (the fast engine's)."""
        return None

    @torch.no_grad()
    def generate_iter(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        gen, stops = self._begin(prompt_ids, params)
        dev = self.target.device
        proposer, verifier = self._request_proposer(params), self._verifier()
        capture = proposer.needs_aux
        rows = verifier.prefill(list(prompt_ids), capture)
        if params.temperature <= 0:
            last = int(rows.top[-1]) if rows.top is not None else int(rows.logits[-1].argmax())
        else:
            last = sample(target_probs(rows.logits[-1], params), gen)
        context = list(prompt_ids) + [last]
        proposer.begin(list(prompt_ids), context, rows.aux, len(prompt_ids) + params.max_new_tokens + 64)
        produced = 1
        finished = last in stops or produced >= params.max_new_tokens
        yield StepOutput(token_ids=[last], finished=finished,
                         finish_reason=("stop" if last in stops else "length") if finished else None)
        device = None if finished else self._device_steps_for(proposer, context, produced, params, stops)
        if device is not None:
            yield from device
            return
        while not finished:
            P = len(context) - 1  # tokens in the target cache; context[-1] is not yet in it
            draft = proposer.propose(context, min(self.k, params.max_new_tokens - produced), params, gen)
            rows = verifier.verify([context[-1], *draft.tokens], P, draft, capture)
            path, bonus = accept(draft, rows, params, gen)
            verifier.keep(P, path)
            new_tokens = [draft.tokens[i] for i in path] + [bonus]
            if capture:
                kept = torch.tensor([0] + [1 + i for i in path], device=dev)
                proposer.commit(rows.aux.index_select(0, kept), torch.tensor(new_tokens, device=dev))
            out = step_output(new_tokens, len(path), max(draft.depths(), default=-1) + 1, len(draft), context,
                              produced, params.max_new_tokens, stops)
            produced += len(out.token_ids)
            finished = out.finished
            yield out

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
