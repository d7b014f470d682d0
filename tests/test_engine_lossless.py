"""Speculative greedy output must be token-identical to plain greedy decoding, for every
architecture, chain and tree, any k, random and well-matched drafters."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.engine.api import SamplingParams
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.tree import Draft, TreeConfig
from specdec.models.drafter import DrafterConfig, Eagle3Drafter
from tests.conftest import ARCHS

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def random_drafter(target, seed=0, draft_vocab=200):
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=target.aux_layer_ids)
    d = Eagle3Drafter(cfg)
    d.embed_tokens.weight.data.copy_(target.embed_tokens().weight)
    d.set_vocab_mapping(torch.randperm(target.vocab_size)[:draft_vocab])
    return d.eval()


class OracleProposer:
    """A well-matched drafter: proposes the target's true greedy continuation, corrupted at a
    random depth, as a chain or as a tree whose correct branch hides among wrong siblings."""

    def __init__(self, reference: list[int], prompt_len: int, seed: int, width: int = 1, vocab: int = 250):
        self.ref, self.n0 = reference, prompt_len
        self.rng = random.Random(seed)
        self.width, self.vocab = width, vocab

    needs_aux = False

    def begin(self, prompt_ids, context, aux, max_len):
        pass

    def commit(self, aux, new_tokens):
        pass

    def propose(self, context, k, params=None, gen=None):
        pos = len(context) - self.n0  # index in the reference of the next token to propose
        truth = self.ref[pos : pos + k]
        if not truth:
            return Draft()
        wrong_at = self.rng.randrange(len(truth) + 1)
        tokens, parents, parent = [], [], -1
        for d, t in enumerate(truth):
            siblings = [self.rng.randrange(self.vocab) for _ in range(self.width - 1)]
            good = t if d != wrong_at else (t + 1) % self.vocab
            kids = siblings + [good]
            self.rng.shuffle(kids)
            first = len(tokens)
            for tok in kids:
                tokens.append(tok)
                parents.append(parent)
            parent = first + kids.index(good)  # continue below the (possibly wrong) good node
        return Draft(tokens=tokens, parents=parents)


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle_chain_and_tree_match_plain(tiny_targets, arch):
    target = tiny_targets[arch]
    drafter = random_drafter(target)
    prompt = torch.randint(0, 250, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = SpeculativeEngine(target).generate(prompt, GREEDY).token_ids
    for k in (1, 3, 5, 7):
        assert SpeculativeEngine(target, drafter=drafter, k=k).generate(prompt, GREEDY).token_ids == ref
    tree = TreeConfig(depth=4, top_k=3, total_tokens=10)
    assert SpeculativeEngine(target, drafter=drafter, tree=tree).generate(prompt, GREEDY).token_ids == ref
    assert SpeculativeEngine(target, ngram=3, k=4).generate(prompt, GREEDY).token_ids == ref


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, 249), min_size=1, max_size=16),
    k=st.sampled_from([1, 3, 5, 7]),
    width=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 1000),
)
def test_well_matched_drafts_accept_and_stay_lossless(tiny_targets, arch, prompt, k, width, seed):
    target = tiny_targets[arch]
    ref = SpeculativeEngine(target).generate(prompt, GREEDY)
    oracle = OracleProposer(ref.token_ids, len(prompt), seed, width=width)
    out = SpeculativeEngine(target, proposer=oracle, k=k).generate(prompt, GREEDY)
    assert out.token_ids == ref.token_ids
    assert out.accepted > 0  # the oracle's true prefix must be accepted (exercises rollback)
    assert out.num_steps < ref.num_steps


def test_chain_equals_tree_of_width_one(tiny_targets):
    target = tiny_targets["qwen2"]
    drafter = random_drafter(target, seed=3)
    prompt = list(range(20, 32))
    chain = SpeculativeEngine(target, drafter=drafter, k=4).generate(prompt, GREEDY)
    tree = SpeculativeEngine(target, drafter=drafter,
                             tree=TreeConfig(depth=4, top_k=1, total_tokens=4)).generate(prompt, GREEDY)
    assert chain.token_ids == tree.token_ids
    assert chain.accepted_per_position == tree.accepted_per_position


def test_stops_at_eos_and_length(tiny_targets):
    target = tiny_targets["llama"]
    prompt = [5, 6, 7]
    ref = SpeculativeEngine(target).generate(prompt, GREEDY).token_ids
    stop = ref[5]
    out = SpeculativeEngine(target, ngram=2).generate(
        prompt, SamplingParams(max_new_tokens=24, stop_token_ids=(stop,), ignore_eos=True))
    assert out.token_ids == ref[: ref.index(stop) + 1]
    assert out.finish_reason == "stop"
    short = SpeculativeEngine(target, ngram=2).generate(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(short.token_ids) == 3 and short.finish_reason == "length"
