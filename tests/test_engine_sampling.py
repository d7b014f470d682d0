"""With temperature > 0 the speculative engine must sample from exactly the target's
distribution: compare the empirical joint distribution of two generated tokens with the exact
one computed from the target, on a vocabulary small enough to enumerate."""

import math

import pytest
import torch

from specdec.engine.api import SamplingParams
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.sampling import target_probs
from specdec.engine.tree import TreeConfig
from specdec.models.drafter import DrafterConfig, Eagle3Drafter
from specdec.models.target import Target

VOCAB = 8


@pytest.fixture(scope="module")
def small_vocab_target():
    from transformers import AutoModelForCausalLM

    from specdec.models.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("llama", vocab_size=VOCAB, num_layers=2)
    cfg.eos_token_id = None
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked but not degenerate distribution
    return Target(model.float(), name="small-vocab")


def exact_joint(target, prompt, params):
    with torch.no_grad():
        p1 = target_probs(target.model(torch.tensor([prompt])).logits[0, -1], params)
        joint = torch.zeros(VOCAB, VOCAB)
        for a in range(VOCAB):
            p2 = target_probs(target.model(torch.tensor([prompt + [a]])).logits[0, -1], params)
            joint[a] = p1[a] * p2
    return joint


def chi_square_pvalue(counts, probs):
    n = counts.sum()
    expected = probs * n
    keep = expected > 5
    stat = float((((counts - expected) ** 2) / expected.clamp(min=1e-9))[keep].sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty approximation of the chi-square survival function
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def drafter_for(target):
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target.config, draft_vocab_size=6, aux_layer_ids=target.aux_layer_ids)
    d = Eagle3Drafter(cfg)
    d.embed_tokens.weight.data.copy_(target.embed_tokens().weight)
    d.set_vocab_mapping(torch.tensor([0, 1, 2, 3, 5, 6]))
    with torch.no_grad():
        d.lm_head.weight.mul_(5.0)
    return d.eval()


@pytest.mark.parametrize(
    "mode",
    ["plain", "ngram", "chain", "tree"],
)
def test_sampling_matches_target_distribution(small_vocab_target, mode):
    target = small_vocab_target
    prompt = [1, 2, 1, 2, 1]
    params = SamplingParams(max_new_tokens=2, temperature=0.9, top_p=0.95)
    joint = exact_joint(target, prompt, params)
    kwargs = {
        "plain": {},
        "ngram": {"ngram": 2, "k": 3},
        "chain": {"drafter": drafter_for(target), "k": 3},
        "tree": {"drafter": drafter_for(target), "tree": TreeConfig(depth=2, top_k=3, total_tokens=6)},
    }[mode]
    engine = SpeculativeEngine(target, **kwargs)
    counts = torch.zeros(VOCAB, VOCAB)
    n = 800
    for seed in range(n):
        out = engine.generate(prompt, SamplingParams(max_new_tokens=2, temperature=0.9, top_p=0.95, seed=seed))
        counts[out.token_ids[0], out.token_ids[1]] += 1
    assert chi_square_pvalue(counts.flatten(), joint.flatten()) > 1e-3


def test_seed_reproducible(small_vocab_target):
    engine = SpeculativeEngine(small_vocab_target, drafter=drafter_for(small_vocab_target), k=3)
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    assert engine.generate([1, 2, 3], p).token_ids == engine.generate([1, 2, 3], p).token_ids
