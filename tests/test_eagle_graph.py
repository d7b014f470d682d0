"""StaticChainDrafter and StaticTreeDrafter (fixed shapes, device-side length, CUDA graphs on a
GPU) draft exactly what the eager Eagle3Proposer drafts, round after round, whatever number of
tokens each round commits; and FastEngine with them stays lossless. Run here without graphs: the
same code a graph captures."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dataclasses import replace

from specdec.engine.api import SamplingParams
from specdec.engine.config import FastConfig
from specdec.engine.eagle import Eagle3Proposer
from specdec.engine.eagle_graph import StaticChainDrafter, StaticTreeDrafter
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.fast import FastEngine
from specdec.engine.tree import TreeConfig
from tests.test_engine_lossless import random_drafter

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def sharp_drafter(target, seed):
    """A random drafter whose logits are sharpened, so that drafts depend on the inputs, not on
    near-ties."""
    drafter = random_drafter(target, seed=seed)
    drafter.lm_head.weight.data.mul_(20)
    return drafter


def commit_both(target, eager, static, n, g):
    """The same n random positions (aux states, next tokens) committed to both proposers."""
    width = len(target.aux_layer_ids) * target.hidden_size
    aux, ids = torch.randn(n, width, generator=g), torch.randint(0, target.vocab_size, (n,), generator=g)
    eager.commit(aux, ids)
    static.commit(aux, ids)


def begin_both(target, eager, static, m, g, max_len):
    """A new sequence of m random positions in both proposers."""
    width = len(target.aux_layer_ids) * target.hidden_size
    aux, ids = torch.randn(m, width, generator=g), torch.randint(0, target.vocab_size, (m,), generator=g)
    eager.begin([], [0] + ids.tolist(), aux, max_len)
    static.start(aux, ids)


@pytest.mark.parametrize("arch,k,compile", [("llama", 1, False), ("llama", 4, False), ("qwen3", 1, False),
                                            ("qwen3", 4, False), ("llama", 4, True)])
def test_static_drafts_equal_eager_drafts(tiny_targets, arch, k, compile):
    target = tiny_targets[arch]
    drafter = sharp_drafter(target, seed=3)
    eager = Eagle3Proposer(drafter, k=k)
    # compile: the steps as inductor fuses them (what a GPU captures), here with its CPU backend.
    static = StaticChainDrafter(drafter, k=k, max_len=96, cuda_graphs=False, compile=compile)
    g = torch.Generator().manual_seed(0)
    begin_both(target, eager, static, 9, g, 96)
    drafted = set()
    for round_ in range(12):
        a = eager.propose([], eager.k, GREEDY, None)
        b = static.propose()
        assert b.tokens == a.tokens and b.parents == a.parents, f"round {round_}"
        assert b.is_chain and len(b) == k
        drafted.update(a.tokens)
        commit_both(target, eager, static, 1 + round_ % (k + 1), g)  # every size from 1 (nothing accepted) to k + 1
    assert int(static.length) == eager.length
    assert len(drafted) > 3  # the drafts really moved with the inputs


@pytest.mark.parametrize("arch,tree,compile", [
    ("llama", TreeConfig(depth=4, top_k=3, total_tokens=10), False),
    ("qwen3", TreeConfig(depth=3, top_k=4, total_tokens=60), False),  # fewer nodes than total_tokens: all kept
    ("llama", TreeConfig(depth=1, top_k=5, total_tokens=3), False),
    ("llama", TreeConfig(depth=4, top_k=3, total_tokens=10), True),
])
def test_static_trees_equal_eager_trees(tiny_targets, arch, tree, compile):
    target = tiny_targets[arch]
    drafter = sharp_drafter(target, seed=5)
    eager = Eagle3Proposer(drafter, tree=tree)
    static = StaticTreeDrafter(drafter, tree=tree, max_len=96, cuda_graphs=False, compile=compile)
    g = torch.Generator().manual_seed(1)
    begin_both(target, eager, static, 7, g, 96)
    shapes = set()
    for round_ in range(8):
        a = eager.propose([], eager.k, GREEDY, None)
        b = static.propose()
        assert (b.tokens, b.parents) == (a.tokens, a.parents), f"round {round_}"
        shapes.add(tuple(a.parents))
        commit_both(target, eager, static, 1 + round_ % (tree.depth + 1), g)  # every size from 1 to depth + 1
    nodes = tree.top_k + (tree.depth - 1) * tree.top_k**2
    assert len(b) == min(tree.total_tokens, nodes)
    if tree.depth > 1 and tree.total_tokens < nodes:
        assert len(shapes) > 1  # the selection really moved with the scores


@pytest.mark.skipif(torch.cuda.is_available(), reason="its failure to capture is the absence of CUDA")
def test_a_step_that_cannot_be_captured_is_drafted_without_graphs(tiny_targets):
    """Where compiling or capturing fails (here: no CUDA at all), the drafter warns once and drafts
    the same trees without graphs instead of failing the generation."""
    target = tiny_targets["llama"]
    drafter = sharp_drafter(target, seed=2)
    tree = TreeConfig(depth=3, top_k=3, total_tokens=8)
    eager = Eagle3Proposer(drafter, tree=tree)
    static = StaticTreeDrafter(drafter, tree=tree, max_len=64, cuda_graphs=True)
    g = torch.Generator().manual_seed(2)
    begin_both(target, eager, static, 6, g, 64)
    with pytest.warns(UserWarning, match="drafting without CUDA graphs"):
        b = static.propose()
    a = eager.propose([], eager.k, GREEDY, None)
    assert (b.tokens, b.parents) == (a.tokens, a.parents) and not static.graphs
    commit_both(target, eager, static, 2, g)
    a, b = eager.propose([], eager.k, GREEDY, None), static.propose()
    assert (b.tokens, b.parents) == (a.tokens, a.parents)


@pytest.mark.parametrize("arch,shape,kind", [
    ("llama", {"k": 4}, StaticChainDrafter),
    ("qwen2", {"tree": TreeConfig(depth=3, top_k=3, total_tokens=8)}, StaticTreeDrafter),
])
def test_fast_engine_with_static_drafter_is_lossless(tiny_targets, arch, shape, kind):
    target = tiny_targets[arch]
    prompt = torch.randint(0, 250, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = SpeculativeEngine(target).generate(prompt, GREEDY)
    config = FastConfig(require_cuda=False, max_len=128, prefill_chunk=8)
    kw = dict(drafter=random_drafter(target), **shape)
    eager = FastEngine(target, config=replace(config, static_drafter=False), **kw).generate(prompt, GREEDY)
    static_engine = FastEngine(target, config=config, **kw)
    assert isinstance(static_engine.static, kind)
    got = static_engine.generate(prompt, GREEDY)
    assert got.token_ids == ref.token_ids == eager.token_ids
    assert (got.num_drafts, got.accepted_per_position) == (eager.num_drafts, eager.accepted_per_position)


class _OracleChain(StaticChainDrafter):
    """Drafts the reference continuation, wrong from a depth that depends on the committed length
    (`wrong_at`), so steps accept every count from 0 to k. Its length is the drafter's own device
    counter: a step that commits the wrong count misaligns every later round."""

    def __init__(self, drafter, full: list[int], wrong_at, **kw):
        super().__init__(drafter, **kw)
        self.full, self.wrong_at = full, wrong_at

    def _draft(self) -> None:
        L = int(self.length)  # positions committed = tokens in the target's cache
        want = self.full[L + 1 : L + 1 + self.k]
        want += [0] * (self.k - len(want))
        c = self.wrong_at(L)
        tokens = [t if i < c else (t + 1) % 250 for i, t in enumerate(want)]
        self.drafts.copy_(torch.tensor(tokens))


def test_chain_steps_on_the_device_commit_what_the_target_accepted(tiny_targets):
    """FastEngine's chain steps (drafts copied into the verify step's input, the accepted count
    computed on the device, the next round queued before the host reads): lossless, and the
    acceptance per step is exactly the oracle's schedule, every count from 0 to k."""
    target, k = tiny_targets["llama"], 3
    prompt = torch.randint(0, 250, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ref = SpeculativeEngine(target).generate(prompt, params).token_ids
    full = prompt + ref

    def wrong_at(L):
        return (L * 7) % (k + 2)  # k + 1 and up: every draft right

    engine = FastEngine(target, config=FastConfig(require_cuda=False, max_len=128, prefill_chunk=8),
                        drafter=random_drafter(target), k=k)
    engine.static = _OracleChain(engine.proposer.drafter, full, wrong_at, k=k, max_len=engine.max_len,
                                 cuda_graphs=False)
    got = engine.generate(prompt, params)
    assert got.token_ids == ref
    L, accepted, produced = len(prompt), [0] * k, 1  # replay the schedule on the host
    while produced < params.max_new_tokens:
        n = min(wrong_at(L), k)
        for i in range(n):
            accepted[i] += 1
        L += n + 1
        produced += n + 1
    assert got.accepted_per_position == accepted
    assert len({min(wrong_at(L), k) for L in range(len(prompt), len(full))}) == k + 1


class _Ops(TorchDispatchMode):
    """Records the aten ops a piece of code runs."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.__name__)
        return func(*args, **(kwargs or {}))


# Ops that read a device tensor on the host; inside a CUDA graph capture they abort it.
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "item"}


@pytest.mark.parametrize("kind", ("chain-1", "chain-4", "tree"))
def test_captured_steps_never_read_the_host(tiny_targets, kind):
    """The commit and draft steps are what the CUDA graphs hold: a host read there (e.g. indexing
    with a 0-dim tensor, which calls .item()) fails capture on a GPU, so check it here on CPU."""
    target = tiny_targets["llama"]
    if kind == "tree":
        static = StaticTreeDrafter(random_drafter(target), tree=TreeConfig(depth=3, top_k=3, total_tokens=8),
                                   max_len=64, cuda_graphs=False)
    else:
        static = StaticChainDrafter(random_drafter(target), k=int(kind[-1]), max_len=64, cuda_graphs=False)
    width = len(target.aux_layer_ids) * target.hidden_size
    static.start(torch.randn(5, width), torch.randint(0, target.vocab_size, (5,)))
    if kind != "tree":  # the commit of a verify step's outputs, as FastEngine attaches them
        static.attach(torch.randint(0, target.vocab_size, (static.k + 1,)), torch.randn(static.k + 1, width))
        static.draft()
    for step in (static._draft, static._commit) + ((static._commit_verified,) if kind != "tree" else ()):
        with torch.no_grad(), _Ops() as seen:
            step()
        assert {op.split(".")[0] for op in seen.ops} & HOST_READS == set(), step.__name__
        assert "index_select" in {op.split(".")[0] for op in seen.ops}  # the recorder saw the step
