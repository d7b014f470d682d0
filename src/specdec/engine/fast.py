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
from .config import FastConfig
from .eagle import Eagle3Proposer
from .eagle_graph import StaticChainDrafter, StaticTreeDrafter
from .engine import PlainProposer, Rows, SpeculativeEngine, accept, step_output
from .static_decoder import FastDecoder, causal_mask, prefer_coordinate_descent
from .tree import Draft, TreeConfig, ancestor_mask

GREEDY = SamplingParams(temperature=0.0)


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
        decoder: FastDecoder | None = None,
        config: FastConfig = FastConfig(),
    ):
        """`decoder`: reuse another FastEngine's decoder (same target): its weights, cache and
        captured buckets are shared, so only new bucket sizes compile (its kernel settings hold,
        not `config.kernels`). `config`: how the engine builds and runs (FastConfig)."""
        c = self.config = config
        if c.require_cuda and target.device.type != "cuda":
            raise SpecdecError(
                f"the fast path needs a CUDA GPU; the target is on {target.device}; use the "
                f"reference engine (SpeculativeEngine), which runs anywhere"
            )
        super().__init__(target, drafter=drafter, ngram=ngram, k=k, tree=tree, proposer=proposer)
        ctx = getattr(target.config, "max_position_embeddings", None) or 4096
        self.max_len = min(c.max_len or 2048, ctx)  # prompt + new tokens
        self.buckets = sorted({1, k + 1} | ({tree.total_tokens + 1} if tree else set()))
        self.prefill_chunk = c.prefill_chunk
        # Slots past max_len: a last verify step's draft and padding, a padded prefill chunk, and
        # the scratch slot that warm-ups and padded copies write.
        # At least 64 + chunk, so a decoder shared by engines of other k (<= 63) still fits.
        pad = max(self.buckets[-1], 64) + c.prefill_chunk + 1
        on_cuda = target.device.type == "cuda"
        compile = on_cuda if c.compile is None else c.compile
        self.static = None
        self.steps_on_device = c.steps_on_device
        self._reads = None  # _device_steps' pinned read buffers and their events
        if isinstance(self.proposer, Eagle3Proposer) and c.static_drafter:
            kw = dict(max_len=self.max_len, cuda_graphs=on_cuda and c.cuda_graphs, compile=compile and on_cuda)
            self.static = (StaticChainDrafter(self.proposer.drafter, k=k, kernels=c.drafter_kernels,
                                              kernel_config=c.kernels, **kw)
                           if tree is None else StaticTreeDrafter(self.proposer.drafter, tree=tree, **kw))
        if decoder is not None:
            if decoder.cache_len < self.max_len + pad:
                raise SpecdecError(f"the shared decoder's cache ({decoder.cache_len} slots) is too small")
            self.fast = decoder
            return
        self.fast = FastDecoder(target.model, max_len=self.max_len, aux_layer_ids=target.aux_layer_ids,
                                last_state=target.last_state, pad=pad)
        coordinate_descent = c.coordinate_descent
        if coordinate_descent is None:
            coordinate_descent = prefer_coordinate_descent(target.model)
        if on_cuda or not c.require_cuda:
            self.fast.optimize(compile=compile, cuda_graphs=c.cuda_graphs and on_cuda, mode=c.mode,
                               coordinate_descent=coordinate_descent, kernel_config=c.kernels)

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

    def _verifier(self) -> "StaticVerifier":
        return StaticVerifier(self)

    def _request_proposer(self, params: SamplingParams):
        # Greedy EAGLE-3 drafts with the static drafter; sampling needs the eager proposer's q.
        if self.static is not None and params.temperature <= 0:
            return self.static
        return super()._request_proposer(params)

    def _device_steps_for(self, proposer, context, produced, params, stops):
        if not self.steps_on_device or params.temperature > 0:
            return None
        if isinstance(proposer, StaticChainDrafter):
            return self._device_steps(proposer, context, produced, params.max_new_tokens, stops)
        if isinstance(proposer, PlainProposer):
            return self._device_steps(None, context, produced, params.max_new_tokens, stops)
        return None

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
            path, bonus = accept(Draft(tokens=values[:k], parents=chain), Rows(None, top=values[k:]), GREEDY, None)
            new_tokens = values[: len(path)] + [bonus]
            out = step_output(new_tokens, len(path), k, k, context, produced, max_new, stops)
            produced += len(out.token_ids)
            yield out
            if out.finished:
                return  # a step queued past the end is left to run; begin() and prefill reset the state
            if queued == n + 1:
                queue(queued)
                queued += 1


def _tree_mask(parents: list[int], T: int) -> np.ndarray:
    """[T, T] over [root, *nodes, padding]: row i sees j when j is i or an ancestor."""
    n = len(parents)
    m = np.eye(T, dtype=np.int64)
    m[1 : 1 + n, 0] = 1
    m[1 : 1 + n, 1 : 1 + n] = ancestor_mask(parents).numpy()
    return m


class StaticVerifier:
    """The step loop's verifier on the static decoder: a draft verified in the smallest captured
    bucket that holds it (padded), the accepted tree path compacted with one captured copy;
    rolling back is the next step's slot0, nothing to crop."""

    def __init__(self, engine: FastEngine):
        self.engine, self.fast = engine, engine.fast

    def prefill(self, prompt_ids: list[int], capture: bool) -> Rows:
        self.fast.aux_layer_ids = list(self.engine.target.aux_layer_ids)
        logits, top, aux = self.fast.prefill(prompt_ids, self.engine.prefill_chunk, capture=capture)
        return Rows(logits[None], top.view(1), aux)

    def verify(self, tokens: list[int], P: int, draft: Draft, capture: bool) -> Rows:
        n = len(draft)
        T = self.engine._bucket(n + 1)
        pos = [P] + [P + 1 + d for d in draft.depths()]
        tmask = _tree_mask(draft.parents, T) if n and not draft.is_chain else causal_mask(T)
        b = self.fast.step(tokens, pos, P, tmask, T, capture=capture)
        return Rows(b.logits[: n + 1], b.top[: n + 1], b.aux)

    def keep(self, P: int, path: list[int]) -> None:
        if path and path != list(range(len(path))):
            self.fast.compact(P + 1, [P + 1 + i for i in path])
