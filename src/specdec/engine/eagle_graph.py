"""EAGLE-3 greedy drafting (chains, and EAGLE-2 dynamic trees) in fixed-shape steps that CUDA
graphs can hold.

The eager `Eagle3Proposer` reads the host after every drafted token and keeps its cache length in
a Python int, so a round (commit the accepted tokens, draft k) is ~360 kernel launches plus k host
round trips: for a SmolLM2-sized drafter, many times the cost of the target's verify step
(benchmarks/drafter_step.py). Here the committed length lives on the device, every tensor
has a fixed shape (a commit is padded to k + 1 rows, attention covers the whole preallocated cache
under a length mask), and a round is two graph replays and one read of the k drafted ids.

A tree round has the same shape: each depth feeds the top_k best nodes so far as top_k rows whose
attention mask (committed slots, the row's ancestors, itself) is built on the device, and the
final top-N selection and parent renumbering run there too; the host reads N tokens and N parents.

Same drafts as `Eagle3Proposer` for greedy chains and trees (tests/test_eagle_graph.py); sampling
stays with the eager proposer.
"""

from __future__ import annotations

import warnings

import torch

from ..models.drafter import Eagle3Drafter, small_query_attention
from .eagle_kernels import KernelLayer, applies
from .config import KernelConfig
from .tree import Draft, TreeConfig


class _StaticDrafter:
    """The committed state on the device, the commit step, and graph capture; subclasses add the
    drafting step (`_draft`) and `propose`. A commit carries up to `k + 1` positions."""

    def __init__(self, drafter: Eagle3Drafter, *, k: int, max_len: int, scratch: int,
                 cuda_graphs: bool | None = None, compile: bool = False, kernels: bool = False,
                 kernel_config: KernelConfig = KernelConfig()):
        """`compile`: fuse each step with inductor before capturing it. Captured as they are, the
        steps are ~14 small kernels per drafted token (norms, rotary, the attention's mask), and
        on a 135M target a drafting round then costs more than the target's verify step.
        `kernels`: the layer runs on the fast path's Triton kernels (eagle_kernels.py; chains only),
        with `kernel_config`'s settings.
        `scratch`: cache slots past max_len that a round's drafts write."""
        d = drafter
        p = d.lm_head.weight
        dev, dt = p.device, p.dtype
        cfg = d.cfg
        self.drafter, self.k = d, k
        # Padded commit rows and the last round's drafts write past the committed length.
        self.size = max_len + (k + 1) + scratch
        # Keys and values in one tensor [2, kv heads, slots, head size], the layout the kernels read.
        kv = torch.zeros(2, cfg.num_key_value_heads, self.size, cfg.head_dim, device=dev, dtype=dt)
        self.kc, self.vc = kv[0:1], kv[1:2]
        self.kernel_layer = KernelLayer(d, kv, kernel_config) if kernels else None
        self.causal = torch.ones(k + 1, k + 1, dtype=torch.long, device=dev).tril()  # the kernels' step mask
        self.slots = torch.arange(self.size, device=dev)
        self.rows = torch.arange(k + 1, device=dev)
        self.d2t_ids = d.draft_to_target
        n_aux = len(cfg.aux_layer_ids)
        # Inputs of a commit: the target's aux states and the next tokens of up to k + 1 positions.
        self.in_aux = torch.zeros(1, k + 1, n_aux * cfg.target_hidden_size, device=dev, dtype=dt)
        self.in_ids = torch.zeros(1, k + 1, dtype=torch.long, device=dev)
        self.in_n = torch.ones((), dtype=torch.long, device=dev)
        # State: committed length, and the drafter's output at the last committed position.
        self.length = torch.zeros((), dtype=torch.long, device=dev)
        self.hidden = torch.zeros(1, 1, cfg.hidden_size, device=dev, dtype=dt)
        self.logits = torch.zeros(1, 1, cfg.draft_vocab_size, device=dev, dtype=dt)
        self.graphs = (dev.type == "cuda") if cuda_graphs is None else cuda_graphs
        self._commit_graph = self._draft_graph = self._verified_graph = None
        self._eager_steps = {"_commit_graph": self._commit, "_draft_graph": self._draft,
                             "_verified_graph": self._commit_verified}
        self._steps = self._eager_steps
        if compile:
            # Without coordinate-descent tuning: tuning every kernel of a tree's six unrolled depths
            # takes minutes of compiling, and the chain's round is fast enough without it.
            self._steps = {name: torch.compile(fn, dynamic=False, fullgraph=True,
                                               options={"coordinate_descent_tuning": False})
                           for name, fn in self._eager_steps.items()}

    # -- the steps -------------------------------------------------------------------------
    def _layer(self, ids, hidden, pos, mask, aux: bool, slots=None):
        """One drafter layer over T rows: rope positions `pos` [T], cache slots `slots` [T]
        (default: `pos`), `mask` bool [T, size] (True = may attend)."""
        T = ids.shape[1]
        if self.kernel_layer is not None and T <= self.k + 1:
            # A chain's commit or draft: `mask` is causal over contiguous slots. (A prompt's longer
            # first commit runs the modules below, on the same cache.)
            return self.kernel_layer(ids, hidden, pos, self.causal[:T, :T].contiguous(), aux)
        d = self.drafter
        if aux:
            hidden = d.project_aux(hidden)
        slots = pos if slots is None else slots

        def attend(q, k, v):
            self.kc.index_copy_(2, slots, k)
            self.vc.index_copy_(2, slots, v)
            return small_query_attention(q, self.kc, self.vc, mask)

        return d.head(d.layer(ids, hidden, pos[None], attend))

    def _causal(self, pos):
        """Row r attends the slots up to and including pos[r]; shape: [T, size]."""
        return self.slots[None, :] <= pos[:, None]

    def _commit(self) -> None:
        pos = self.length + self.rows
        h, lg = self._layer(self.in_ids, self.in_aux, pos, self._causal(pos), aux=True)
        last = (self.in_n - 1).view(1)
        self.hidden.copy_(h.index_select(1, last))
        self.logits.copy_(lg.index_select(1, last))
        self.length.add_(self.in_n)

    def _commit_verified(self) -> None:
        """Commit what the target's verify step accepted, read on the device (`attach`): the
        drafts up to the first the target's argmax disagrees with, then the target's own token.
        Those k + 1 next tokens are the verify step's argmax rows 0..n - 1 themselves."""
        k = self.k
        agree = (self.drafts == self.v_top[:k]).long().cumprod(0).sum()
        self.in_ids[0].copy_(self.v_top[: k + 1])
        self.in_aux[0].copy_(self.v_aux[: k + 1])
        self.in_n.copy_(agree + 1)
        self._commit()

    def _replay(self, name: str) -> None:
        fn = self._steps[name]
        if not self.graphs:
            fn()
            return
        g = getattr(self, name)
        if g is None:
            state = (self.kc, self.vc, self.length, self.hidden, self.logits)
            saved = [t.clone() for t in state]
            try:
                g = self._capture(fn, state, saved)
            except Exception as e:  # this torch/GPU cannot compile or capture the step: draft without
                for t, s in zip(state, saved):
                    t.copy_(s)
                warnings.warn(f"{type(self).__name__}: capturing a drafting step failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); drafting without CUDA graphs (same drafts, slower)", stacklevel=2)
                self.graphs = False
                self._steps = self._eager_steps
                self._steps[name]()
                return
            setattr(self, name, g)
        g.replay()

    @staticmethod
    def _capture(fn, state, saved) -> "torch.cuda.CUDAGraph":
        # Warm up on a side stream (compile; kernels pick their configs; inductor allocates
        # lazily, so twice) and undo what it wrote; the capture only records, so the replay after
        # it is the step's one real run.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
                for t, s in zip(state, saved):
                    t.copy_(s)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    # -- the proposer's interface (engine.Proposer) ------------------------------------------
    needs_aux = True

    def begin(self, prompt_ids: list[int], context: list[int], aux: torch.Tensor, max_len: int | None = None) -> None:
        """A new request (its length fits: the engine sized this drafter's cache)."""
        self.start(aux, torch.tensor(context[1:], device=aux.device))

    @torch.no_grad()
    def start(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """A new sequence: commit the prompt's m positions (aux [m, 3tH], next_tokens [m]) eagerly,
        once, since m varies."""
        m = next_tokens.numel()
        self.length.zero_()
        pos = torch.arange(m, device=self.kc.device)
        h, lg = self._layer(next_tokens.view(1, m), aux.view(1, m, -1).to(self.in_aux.dtype), pos,
                            self._causal(pos), aux=True)
        self.hidden.copy_(h[:, -1:])
        self.logits.copy_(lg[:, -1:])
        self.length.fill_(m)

    @torch.no_grad()
    def commit(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Extend over accepted positions: aux [n, 3tH], next_tokens [n], n <= k + 1."""
        n = next_tokens.numel()
        self.in_aux[0, :n].copy_(aux)
        self.in_ids[0, :n].copy_(next_tokens)
        self.in_n.fill_(n)
        self._replay("_commit_graph")

    @torch.no_grad()
    def warm(self) -> None:
        """Capture both graphs now (a dummy one-token sequence; the next begin() resets it)."""
        dev = self.kc.device
        aux, ids = self.in_aux[0, :1].clone(), torch.zeros(1, dtype=torch.long, device=dev)
        self.start(aux, ids)
        self.propose()
        self.commit(aux, ids)
        self.propose()


class StaticChainDrafter(_StaticDrafter):
    """A greedy chain of k drafts per round.

    Two ways to drive it. `propose` / `commit`: the host reads the drafts and hands back what was
    accepted. Or, with the target's verify step on the device too (FastEngine): `draft` queues a
    round whose drafts stay in `drafts`, `attach` names the verify step's argmax and aux buffers,
    and `commit_verified` queues the commit of what they accepted, so a speculative step queues
    commit, drafts and verify back to back and the host reads once, after the verify."""

    def __init__(self, drafter: Eagle3Drafter, *, k: int, max_len: int, cuda_graphs: bool | None = None,
                 compile: bool = False, kernels: bool | None = None,
                 kernel_config: KernelConfig = KernelConfig()):
        """`kernels` (None: on a GPU where they apply, eagle_kernels.applies)."""
        if kernels is None:
            kernels = drafter.lm_head.weight.is_cuda and applies(drafter, k + 1, kernel_config)
        super().__init__(drafter, k=k, max_len=max_len, scratch=k + 1, cuda_graphs=cuda_graphs, compile=compile,
                         kernels=kernels, kernel_config=kernel_config)
        self.drafts = torch.zeros(k, dtype=torch.long, device=self.kc.device)

    def _draft(self) -> None:
        h, lg = self.hidden, self.logits
        for i in range(self.k):
            # index_select, not d2t[t]: indexing with a 0-dim tensor reads it on the host
            # (.item()), which a CUDA graph capture refuses.
            tok = self.d2t_ids.index_select(0, lg[0, -1].argmax(-1).view(1))
            self.drafts[i : i + 1].copy_(tok)
            if i == self.k - 1:
                break
            p = (self.length + i).view(1)
            h, lg = self._layer(tok.view(1, 1), h, p, self._causal(p), aux=False)

    @torch.no_grad()
    def propose(self, context=None, limit=None, params=None, gen=None) -> Draft:
        """A round of k drafts (greedy; what the engine passes is not needed)."""
        self._replay("_draft_graph")
        tokens = self.drafts.tolist()  # the round's one host read
        return Draft(tokens=tokens, parents=list(range(-1, len(tokens) - 1)))

    @torch.no_grad()
    def draft(self) -> None:
        """Queue a round; its k drafts land in `drafts` (nothing is read)."""
        self._replay("_draft_graph")

    def attach(self, top: torch.Tensor, aux: torch.Tensor) -> None:
        """The verify step's argmax [>= k + 1] and aux states [>= k + 1, 3tH] that `commit_verified`
        reads. A captured commit holds their addresses: new tensors drop it (it is captured again)."""
        if getattr(self, "v_top", None) is top and self.v_aux is aux:
            return
        self.v_top, self.v_aux = top, aux
        self._verified_graph = None

    @torch.no_grad()
    def commit_verified(self) -> None:
        """Queue the commit of the last verify step's accepted tokens (see `attach`)."""
        self._replay("_verified_graph")


class StaticTreeDrafter(_StaticDrafter):
    """A greedy EAGLE-2 dynamic tree per round, as `Eagle3Proposer` builds it: depth 0 is the top_k
    of the drafter's last output; each further depth feeds the top_k best nodes of the previous
    one (cumulative log-probability) and adds their top_k children each; the round keeps the
    `total_tokens` best nodes (with cumulative scores a parent always outranks its children)."""

    def __init__(self, drafter: Eagle3Drafter, *, tree: TreeConfig, max_len: int, cuda_graphs: bool | None = None,
                 compile: bool = False):
        depth, width = tree.depth, tree.top_k
        super().__init__(drafter, k=depth, max_len=max_len, scratch=max(depth - 1, 1) * width,
                         cuda_graphs=cuda_graphs, compile=compile)
        dev = self.kc.device
        self.depth, self.width = depth, width
        self.nodes = width + (depth - 1) * width * width
        self.keep = min(tree.total_tokens, self.nodes)
        self.node_tok = torch.zeros(self.nodes, dtype=torch.long, device=dev)
        self.node_parent = torch.full((self.nodes,), -1, dtype=torch.long, device=dev)
        self.node_score = torch.zeros(self.nodes, dtype=torch.float32, device=dev)
        self.lanes = torch.arange(width, device=dev)
        self.out = torch.zeros(2, self.keep, dtype=torch.long, device=dev)  # tokens, parents

    def _draft(self) -> None:
        W = self.width
        logq = torch.log_softmax(self.logits[0, -1].float(), -1)
        score, idx = logq.topk(W)
        self.node_tok[:W].copy_(self.d2t_ids.index_select(0, idx))  # node_parent[:W] stays -1 (the root's)
        self.node_score[:W].copy_(score)
        committed = self.slots < self.length  # shape: [size]
        h = self.hidden.expand(1, W, -1)
        anc = committed[None].expand(W, -1)  # what each depth-0 node's parent (the root) sees
        start, count = 0, W  # the nodes made at the current depth
        for d in range(self.depth - 1):
            # The depth's W best nodes, best first, are fed as W rows.
            best, local = self.node_score[start : start + count].topk(W)
            fed = start + local
            row_of_parent = local // W if d else torch.zeros_like(local)
            slots = self.length + d * W + self.lanes
            mask = anc.index_select(0, row_of_parent) | (self.slots[None, :] == slots[:, None])
            hid = h.index_select(1, row_of_parent) if d else h
            pos = (self.length + d).expand(W)
            h, lg = self._layer(self.node_tok.index_select(0, fed)[None], hid, pos, mask, aux=False, slots=slots)
            logq = torch.log_softmax(lg[0].float(), -1)  # shape: [W, Vd]
            score, idx = logq.topk(W)  # shapes: [W, W]
            start, count = start + count, W * W
            self.node_tok[start : start + count].copy_(self.d2t_ids.index_select(0, idx.reshape(-1)))
            self.node_parent[start : start + count].copy_(fed[:, None].expand(W, W).reshape(-1))
            self.node_score[start : start + count].copy_((best[:, None] + score).reshape(-1))
            anc = mask
        # Keep the best `keep` nodes in creation order (parents before children), renumbered.
        kept = self.node_score.topk(self.keep).indices.sort().values
        renumber = torch.full((self.nodes + 1,), -1, dtype=torch.long, device=kept.device)
        renumber[kept] = torch.arange(self.keep, device=kept.device)
        parents = self.node_parent.index_select(0, kept)
        self.out[0].copy_(self.node_tok.index_select(0, kept))
        self.out[1].copy_(renumber.index_select(0, torch.where(parents < 0, self.nodes, parents)))

    @torch.no_grad()
    def propose(self, context=None, limit=None, params=None, gen=None) -> Draft:
        """A round's tree (greedy; what the engine passes is not needed)."""
        self._replay("_draft_graph")
        tokens, parents = self.out.tolist()  # the round's one host read
        return Draft(tokens=tokens, parents=parents)
