"""The fast engine: `SpeculativeEngine`'s API and lossless acceptance on the static decoder
(`static_decoder.py`). Greedy plain and EAGLE-3 chain steps can run on the device
(`FastEngine._device_steps`): the device writes the next step's staging itself and the host reads
each step while the next one runs. `choice.make_engine` picks this engine where it applies.

Examples:
    from specdec.engine.choice import make_engine
    engine = make_engine(load_target("smollm2-135m-instruct"), ngram=3, k=7)
    print(engine.generate(prompt_ids, SamplingParams(max_new_tokens=256)).stats())

    python benchmarks/smollm2.py       # GPU: ms/token against HF eager, same run
"""

from __future__ import annotations

import itertools
import time
from typing import Iterator

import numpy as np
import torch

from ..errors import SpecdecError
from ..models.target import Target
from .api import SamplingParams, StepOutput
from .eagle import Eagle3Proposer
from .eagle_graph import StaticChainDrafter, StaticTreeDrafter
from .engine import SpeculativeEngine, step_output
from .sampling import sample, target_probs
from .static_decoder import FastDecoder, causal_mask, prefer_coordinate_descent
from .tree import Draft, TreeConfig, ancestor_mask


class FastEngine(SpeculativeEngine):
    """Same API and lossless acceptance as `SpeculativeEngine`, on a `FastDecoder`.

    Buckets (one compiled step and one CUDA graph each): 1 (plain, or an empty draft), k+1 (a
    chain draft, padded), the tree size + 1 (a tree draft) and `prefill_chunk`."""

    _context_name = "the fast path's cache"
    _context_hint = "; pass a larger max_len"

    def __init__(
        self,
        target: Target,
        *,
        drafter=None,
        ngram: int | None = None,
        k: int = 5,
        tree: TreeConfig | None = None,
        proposer=None,
        max_len: int | None = None,
        prefill_chunk: int = 32,
        compile: bool | None = None,
        cuda_graphs: bool = True,
        mode: str | None = None,
        coordinate_descent: bool | None = None,
        require_cuda: bool = True,
        decoder: FastDecoder | None = None,
        static_drafter: bool = True,
        pack_weights: bool | None = None,
        drafter_kernels: bool | None = None,
        steps_on_device: bool = True,
    ):
        """`decoder`: reuse another FastEngine's decoder (same target): its weights, cache and
        captured buckets are shared, so only new bucket sizes compile. `static_drafter`: greedy
        EAGLE-3 chains and trees draft with `StaticChainDrafter` / `StaticTreeDrafter` (compiled
        and in CUDA graphs on a GPU: a round many times faster than eager, same drafts;
        benchmarks/drafter_step.py); False keeps the eager proposer (sampling always
        uses it). `compile`: inductor on the decoder's steps (default: on a CUDA GPU only; True
        compiles on a CPU too, as `make_engine`'s CPU fast path does). `pack_weights`: a packed
        second copy of the large products' weights for the kernels (`FastDecoder.optimize`'s `pack`;
        None: gemv.PACK_WEIGHTS, off). `drafter_kernels`: a static chain drafter's layer on the
        Triton kernels (eagle_kernels.py; None: on a GPU where they apply). `steps_on_device`: greedy
        plain steps and such a drafter's chain steps compute their next input on the device and the
        host reads a step while the next runs (`_device_steps`); False: the host builds every
        step's input from what it read (for chains two reads, the drafts then the argmax)."""
        if require_cuda and target.device.type != "cuda":
            raise SpecdecError(
                f"the fast path needs a CUDA GPU; the target is on {target.device}; use the "
                f"reference engine (SpeculativeEngine), which runs anywhere"
            )
        super().__init__(target, drafter=drafter, ngram=ngram, k=k, tree=tree, proposer=proposer)
        ctx = getattr(target.config, "max_position_embeddings", None) or 4096
        self.max_len = min(max_len or 2048, ctx)  # prompt + new tokens
        self.buckets = sorted({1, k + 1} | ({tree.total_tokens + 1} if tree else set()))
        self.prefill_chunk = prefill_chunk
        # Slots past max_len: a last verify step's draft and padding, a padded prefill chunk, and
        # the scratch slot that warm-ups and padded copies write.
        # At least 64 + chunk, so a decoder shared by engines of other k (<= 63) still fits.
        pad = max(self.buckets[-1], 64) + prefill_chunk + 1
        on_cuda = target.device.type == "cuda"
        compile = on_cuda if compile is None else compile
        self.static = None
        self.steps_on_device = steps_on_device
        self._reads = None  # _device_steps' pinned read buffers and their events
        if isinstance(self.proposer, Eagle3Proposer) and static_drafter:
            kw = dict(max_len=self.max_len, cuda_graphs=on_cuda and cuda_graphs, compile=compile and on_cuda)
            self.static = (StaticChainDrafter(self.proposer.drafter, k=k, kernels=drafter_kernels, **kw)
                           if tree is None else StaticTreeDrafter(self.proposer.drafter, tree=tree, **kw))
        if decoder is not None:
            if decoder.cache_len < self.max_len + pad:
                raise SpecdecError(f"the shared decoder's cache ({decoder.cache_len} slots) is too small")
            self.fast = decoder
            return
        self.fast = FastDecoder(target.model, max_len=self.max_len, aux_layer_ids=target.aux_layer_ids,
                                last_state=target.last_state, pad=pad)
        if coordinate_descent is None:
            coordinate_descent = prefer_coordinate_descent(target.model)
        if on_cuda or not require_cuda:
            self.fast.optimize(compile=compile, cuda_graphs=cuda_graphs and on_cuda,
                               mode=mode, coordinate_descent=coordinate_descent, pack=pack_weights)

    def warmup(self) -> float:
        """Compile and capture every bucket now; returns the seconds it took."""
        t0 = time.perf_counter()
        capture = isinstance(self.proposer, Eagle3Proposer)
        self.fast.aux_layer_ids = list(self.target.aux_layer_ids)
        self.fast.warmup(sorted(set(self.buckets) | {self.prefill_chunk}), capture)
        if self.static is not None:
            self.static.warm()
        b = self.fast.buffers(self.k + 1, capture)
        if isinstance(self.static, StaticChainDrafter) and b is not None and b.graph is not None:
            self.static.attach(b.top, b.aux)  # and its commit of a verify step's outputs, captured
            self.static.commit_verified()
        return time.perf_counter() - t0

    def _bucket(self, n: int) -> int:
        for T in self.buckets:
            if T >= n:
                return T
        raise SpecdecError(f"a draft of {n - 1} tokens exceeds the largest verify bucket {self.buckets[-1] - 1}")

    @torch.no_grad()
    def generate_iter(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        gen, stops = self._begin(prompt_ids, params)
        dev = self.target.device
        greedy = params.temperature <= 0
        eagle = isinstance(self.proposer, Eagle3Proposer)
        static = self.static if eagle and greedy else None
        self.fast.aux_layer_ids = list(self.target.aux_layer_ids)
        logits, top, aux = self.fast.prefill(list(prompt_ids), self.prefill_chunk, capture=eagle)
        last = int(top) if greedy else sample(target_probs(logits.float(), params), gen)
        context = list(prompt_ids) + [last]
        if static is not None:
            static.begin(aux, torch.tensor(context[1:], device=dev))
        elif eagle:
            self.proposer.reset(len(prompt_ids) + params.max_new_tokens + 64)
            self.proposer.commit(aux[None], torch.tensor(context[1:], device=dev))
        elif self.proposer is not None:
            self.proposer.reset(prompt_ids)
        produced = 1
        finished = last in stops or produced >= params.max_new_tokens
        yield StepOutput(token_ids=[last], finished=finished,
                         finish_reason=("stop" if last in stops else "length") if finished else None)
        on_device = isinstance(static, StaticChainDrafter) or (greedy and self.proposer is None)
        if on_device and self.steps_on_device and not finished:
            yield from self._device_steps(static, context, produced, params.max_new_tokens, stops)
            return
        while not finished:
            P = len(context) - 1  # tokens in the cache; context[-1] is not yet in it
            budget = params.max_new_tokens - produced
            if static is not None:
                draft = static.propose()
            elif eagle:
                draft = self.proposer.propose(params, gen, self.target.vocab_size)
            elif self.proposer is not None:
                draft = self.proposer.propose(context, min(self.k, budget))
            else:
                draft = Draft()
            n = len(draft)
            T = self._bucket(n + 1)
            depths = draft.depths()
            pos = [P] + [P + 1 + d for d in depths]
            tmask = _tree_mask(draft.parents, T) if n and not draft.is_chain else causal_mask(T)
            b = self.fast.step([context[-1], *draft.tokens], pos, P, tmask, T, capture=eagle)
            if greedy:
                path, bonus = _greedy_walk(draft, b.top[: n + 1].tolist())
            else:
                path, bonus = self._accept(draft, b.logits[: n + 1].float(), params, gen)
            if path and path != list(range(len(path))):
                self.fast.compact(P + 1, [P + 1 + i for i in path])
            new_tokens = [draft.tokens[i] for i in path] + [bonus]
            if eagle:
                rows = torch.tensor([0] + [1 + i for i in path], device=dev)
                if static is not None:
                    static.commit(b.aux[rows], torch.tensor(new_tokens, device=dev))
                else:
                    self.proposer.commit(b.aux[rows][None], torch.tensor(new_tokens, device=dev))
            out = step_output(new_tokens, len(path), max(depths, default=-1) + 1, n, context, produced,
                              params.max_new_tokens, stops)
            produced += len(out.token_ids)
            finished = out.finished
            yield out

    def _device_steps(self, static: StaticChainDrafter | None, context: list[int], produced: int, max_new: int,
                      stops) -> Iterator[StepOutput]:
        """Greedy steps whose next input the device computes, plain (`static` None) or EAGLE-3
        chains: after a verify the drafter commits what the target accepted (counted on the device)
        and drafts the next round, and the staging buffer advances on the device (slot and
        positions by the committed count, the target's own token at the front, the new drafts
        behind it). The host only reads each step's drafts and argmax (one pinned copy per step),
        and reads step n while step n + 1 runs: it queues a step before walking the previous one
        wherever that one cannot end the request by length, so the GPU does not wait for the
        host's bookkeeping between steps."""
        k = 0 if static is None else self.k
        T, capture = k + 1, static is not None
        cuda = self.target.device.type == "cuda"
        chain = list(range(-1, k - 1))
        P = len(context) - 1
        b = self.fast.stage([context[-1]] + [0] * k, list(range(P, P + T)), P, causal_mask(T), T, capture=capture)
        st = b.staging
        one = torch.ones((), dtype=torch.long, device=st.device)
        # Two pinned read buffers, drafts then argmax: step n's is read while step n + 1 is queued.
        # Kept across requests (pinning memory costs more than a step).
        if self._reads is None or self._reads[0][0].numel() != k + T:
            self._reads = ([torch.empty(k + T, dtype=torch.long, pin_memory=cuda) for _ in range(2)],
                           [torch.cuda.Event() if cuda else None for _ in range(2)])
        hosts, ready = self._reads
        if static is not None:
            static.draft()  # the first round, from the prompt begin() committed

        def queue(n: int) -> None:
            if static is not None:
                st[2 : 1 + T].copy_(static.drafts)  # ids[1:]
            self.fast.run(b, capture=capture)
            h = hosts[n % 2]
            if static is not None:
                h[:k].copy_(static.drafts, non_blocking=cuda)
            h[k:].copy_(b.top[:T], non_blocking=cuda)
            if cuda:
                ready[n % 2].record()
            if static is not None:
                static.attach(b.top, b.aux)
                static.commit_verified()  # in_n = accepted + 1
                static.draft()
            n_new = one if static is None else static.in_n
            st[1:2].copy_(b.top.index_select(0, n_new.view(1) - 1))  # the target's own token
            st[0:1].add_(n_new)  # slot0
            st[1 + T : 1 + 2 * T].add_(n_new)  # rope positions

        queue(0)
        queued = 1
        for n in itertools.count():
            if queued == n + 1 and produced + T < max_new:  # step n cannot end the request by length
                queue(queued)
                queued += 1
            if cuda:
                ready[n % 2].synchronize()
            values = hosts[n % 2].tolist()
            path, bonus = _greedy_walk(Draft(tokens=values[:k], parents=chain), values[k:])
            new_tokens = values[: len(path)] + [bonus]
            out = step_output(new_tokens, len(path), k, k, context, produced, max_new, stops)
            produced += len(out.token_ids)
            yield out
            if out.finished:
                return  # a step queued past the end is left to run; begin() and prefill reset the state
            if queued == n + 1:
                queue(queued)
                queued += 1


def _greedy_walk(draft: Draft, top: list[int]) -> tuple[list[int], int]:
    """Longest draft path whose every token is the target's argmax at its parent; the bonus
    token is the argmax after the path. `top[0]` is the root's row, `top[1 + i]` node i's."""
    children = draft.children()
    path: list[int] = []
    node = -1
    while True:
        best = top[0 if node < 0 else 1 + node]
        match = next((c for c in children.get(node, []) if draft.tokens[c] == best), None)
        if match is None:
            return path, best
        path.append(match)
        node = match


def _tree_mask(parents: list[int], T: int) -> np.ndarray:
    """[T, T] over [root, *nodes, padding]: row i sees j when j is i or an ancestor."""
    n = len(parents)
    m = np.eye(T, dtype=np.int64)
    m[1 : 1 + n, 0] = 1
    m[1 : 1 + n, 1 : 1 + n] = ancestor_mask(parents).numpy()
    return m
