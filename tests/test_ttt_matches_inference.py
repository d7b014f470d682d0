"""Training-time test must unroll exactly what inference drafts: the chain the engine's proposer
drafts from a prefix is what `ttt_unroll` predicts at the prefix's last index, step by step."""

import pytest
import torch

from specdec.engine.api import SamplingParams
from specdec.engine.eagle import Eagle3Proposer
from specdec.models.drafter import DrafterConfig, Eagle3Drafter
from specdec.train.ttt import ttt_unroll


def random_drafter(target, seed: int, norm_output: bool, norm_before_residual: bool):
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.config, draft_vocab_size=128, aux_layer_ids=target.aux_layer_ids,
                                   norm_output=norm_output, norm_before_residual=norm_before_residual)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 1.0)  # large enough that the argmax depends on every input
        d.set_vocab_mapping(torch.randperm(target.vocab_size)[:128])
    return d.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("norm_output,norm_before_residual", [(False, False), (True, True)])
@pytest.mark.parametrize("P", [2, 11, 40])
def test_chain_draft_equals_ttt_unroll(tiny_targets, arch, norm_output, norm_before_residual, P):
    target = tiny_targets[arch]
    drafter = random_drafter(target, seed=P, norm_output=norm_output, norm_before_residual=norm_before_residual)
    k = 6
    prompt = torch.randint(3, target.vocab_size, (1, P), generator=torch.Generator().manual_seed(P))
    with torch.no_grad():
        out = target.forward(prompt, capture=True)
    bonus = int(out.logits[0, -1].argmax())

    proposer = Eagle3Proposer(drafter, k=k)
    proposer.begin(prompt[0].tolist(), prompt[0].tolist() + [bonus], out.aux_hidden[0], 64)
    drafts = proposer.propose([], k, SamplingParams(temperature=0.0), None).tokens
    assert len(drafts) == k

    # Teacher forcing on [prompt, bonus, d1..d(k-1)]: index P-1, step s reads token P+s, predicts d(s+1).
    seq = torch.cat([prompt[0], torch.tensor([bonus] + drafts[:-1])])[None]
    aux = torch.zeros(1, seq.shape[1], out.aux_hidden.shape[-1])
    aux[:, :P] = out.aux_hidden  # later indices are never read by index P-1
    d2t = drafter.draft_to_target
    with torch.no_grad():
        steps = [logits[0, P - 1] for logits in ttt_unroll(drafter, seq, aux, k)]
    torch.testing.assert_close(steps[0], proposer.last_logits, rtol=1e-4, atol=1e-4)
    assert [int(d2t[lg.argmax()]) for lg in steps] == drafts


class _MemorySource:
    def __init__(self, samples):
        self.samples, self.lengths = samples, [len(s["input_ids"]) for s in samples]

    def get(self, indices, shape=None):
        return [dict(self.samples[i]) for i in indices]


def test_cached_target_argmax_gives_the_same_loss(tiny_targets):
    """Training reuses each sample's target argmax after its first epoch: same loss, same counts."""
    from specdec.train.ttt import Batch, TargetArgmaxCache, TargetHead, ttt_loss

    target = tiny_targets["llama"]
    drafter = random_drafter(target, seed=1, norm_output=False, norm_before_residual=False)
    head = TargetHead.from_target(target)
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (9, 17, 5):  # different lengths: the batch is padded
        ids = torch.randint(3, target.vocab_size, (n,), generator=g)
        with torch.no_grad():
            out = target.forward(ids[None], capture=True)
        mask = torch.rand(n, generator=g) < 0.7
        samples.append({"input_ids": ids.int(), "loss_mask": mask.to(torch.uint8),
                        "aux_hidden": out.aux_hidden[0], "last_hidden": out.last_hidden[0]})
    src = _MemorySource(samples)
    cache = TargetArgmaxCache(src, head, "cpu")
    order = [2, 0, 1]
    fresh = ttt_loss(drafter, Batch.collate(src.get(order), "cpu"), head, steps=3)
    first = ttt_loss(drafter, Batch.collate(cache.get(order), "cpu"), head, steps=3)
    again = ttt_loss(drafter, Batch.collate(cache.get([1, 2, 0]), "cpu"), head, steps=3)  # from the cache
    assert set(cache.known) == {0, 1, 2}
    for out in (first, again):
        torch.testing.assert_close(out.loss, fresh.loss)
        assert torch.equal(out.counted, fresh.counted) and torch.equal(out.correct, fresh.correct)


def captured_sample(target, n: int, seed: int, assistant: float):
    """Random ids run through the target as `specdec capture` would store them, a random share
    `assistant` of them marked as assistant tokens: (ids, target output, loss mask, sample)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.vocab_size, (n,), generator=g)
    with torch.no_grad():
        out = target.forward(ids[None], capture=True)
    mask = (torch.rand(n, generator=g) < assistant).to(torch.uint8)
    sample = {"input_ids": ids.int(), "loss_mask": mask, "aux_hidden": out.aux_hidden[0],
              "last_hidden": out.last_hidden[0]}
    return ids, out, mask, sample


def test_accuracy_counts_tokens_outside_the_draft_vocab_as_misses(tiny_targets):
    """The simulated acceptance must be what the engine would measure: every assistant token is a
    chance, and one the draft vocab cannot express is a miss, not a position left out."""
    from specdec.train.ttt import Batch, TargetHead, ttt_loss

    target = tiny_targets["llama"]
    head = TargetHead.from_target(target)
    n = 40
    ids, out, mask, sample = captured_sample(target, n, seed=3, assistant=0.8)
    full_argmax = out.logits[0].argmax(-1)  # the target's token after each index
    drafter = random_drafter(target, seed=2, norm_output=False, norm_before_residual=False)
    counts = []  # assistant tokens the vocab cannot express
    for keep in (full_argmax[1:20], full_argmax[1:]):  # a vocab that misses some targets, one that has all
        extra = torch.tensor([t for t in torch.randperm(target.vocab_size).tolist() if t not in set(keep.tolist())])
        drafter.set_vocab_mapping(torch.cat([keep.unique(), extra])[:128])
        with torch.no_grad():
            res = ttt_loss(drafter, Batch.collate([dict(sample)], "cpu"), head, steps=2)
            step0 = next(iter(ttt_unroll(drafter, ids[None], out.aux_hidden, 1)))[0]
        drafted = drafter.draft_to_target[step0.argmax(-1)]  # index t drafts the token at t + 2
        expected = sum(int(mask[t + 2]) and int(drafted[t] == full_argmax[t + 1]) for t in range(n - 2))
        assert int(res.counted) == int(mask[2:].sum())  # every assistant token, whatever the vocab
        assert int(res.step_correct[0]) == expected
        missing = sum(int(mask[t + 2]) and not bool(drafter.t2d[full_argmax[t + 1]]) for t in range(n - 2))
        counts.append(missing)
    assert counts[0] > 0 and counts[1] == 0  # the first vocab really leaves assistant tokens out


def test_feature_loss_pulls_toward_the_state_the_target_reads_next(tiny_targets):
    """The feature loss at index t compares what the drafter computes there at inference (token t+1
    after the target's states at t) with the target's normed final state at t+1, the vector its
    lm_head turns into the distribution the drafter is scored against."""
    from specdec.train.ttt import Batch, TargetHead, ttt_loss

    target = tiny_targets["llama"]
    head = TargetHead.from_target(target)
    n = 30
    ids, out, mask, sample = captured_sample(target, n, seed=5, assistant=0.7)
    batch = Batch.collate([sample], "cpu")
    drafter = random_drafter(target, seed=4, norm_output=True, norm_before_residual=False)
    with torch.no_grad():
        # The inference path: index t reads the token at t + 1 and the target's states at t.
        normed, _ = drafter(ids[None, 1:], out.aux_hidden[:, :-1], torch.arange(n - 1)[None])
        want = head.normed(out.last_hidden[0, 1:])
        err = (normed[0].float() - want).pow(2).sum(-1) / want.pow(2).sum(-1)
        scored = mask[2:].bool()  # index t is scored when the token at t + 2 is an assistant token
        expected = err[: n - 2][scored].mean()
        w = 0.7
        diff1 = ttt_loss(drafter, batch, head, steps=1, feature_weight=w).loss - ttt_loss(drafter, batch, head,
                                                                                        steps=1).loss
        diff2 = ttt_loss(drafter, batch, head, steps=2, feature_weight=w).loss - ttt_loss(drafter, batch, head,
                                                                                        steps=2).loss
    torch.testing.assert_close(diff1, w * expected, rtol=1e-4, atol=1e-5)
    assert diff2 > diff1 + 1e-3  # later steps add their own feature terms


def test_init_layer_starts_the_drafter_as_the_target_layer_after_the_top_aux_state(tiny_targets):
    """`train --init-layer`: with the top aux state passed through fc and the token columns at zero,
    the drafter's layer is the target's layer c = aux_layer_ids[-1] applied to its own input, so
    its output at every index is the state the target hands to layer c + 1."""
    from specdec.train.drafter_init import init_layer_from_target

    target = tiny_targets["llama"]
    saved = target.aux_layer_ids
    target.set_aux_layer_ids([0, 1, 2])  # the top one below the last layer, as in real targets
    try:
        c = target.aux_layer_ids[-1]
        drafter = random_drafter(target, seed=6, norm_output=False, norm_before_residual=False)
        init_layer_from_target(drafter, target, c)
        n = 24
        ids, out, _, _ = captured_sample(target, n, seed=7, assistant=1.0)
    finally:
        target.set_aux_layer_ids(saved)
    with torch.no_grad():
        states = target.model(ids[None], output_hidden_states=True).hidden_states  # [k] = input of layer k
        h, _ = drafter(ids[None, 1:], out.aux_hidden[:, :-1], torch.arange(n - 1)[None])
    torch.testing.assert_close(h[0], states[c + 1][0, :-1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(states[c + 1], states[c], atol=1e-2)  # the layer does change the state


def test_init_layer_auto_copies_what_fits_and_says_what_it_left_random(tiny_targets):
    from specdec.train.drafter_init import start_layer

    target = tiny_targets["llama"]
    cfg = DrafterConfig.for_target(target.config, draft_vocab_size=128, aux_layer_ids=target.aux_layer_ids,
                                   intermediate_size=8)  # narrower than the target's MLP
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    mlp_before = {k: v.clone() for k, v in drafter.midlayer.mlp.state_dict().items()}
    said = start_layer(drafter, target, "auto")
    src = target.layers[min(target.aux_layer_ids[-1], target.num_layers - 1)]
    h = cfg.hidden_size
    assert torch.equal(drafter.midlayer.self_attn.q_proj.weight[:, h:], src.self_attn.q_proj.weight)
    assert "MLP" in said and "random" in said
    assert all(torch.equal(v, mlp_before[k]) for k, v in drafter.midlayer.mlp.state_dict().items())
    assert start_layer(Eagle3Drafter(cfg), target, "none") == "random"


def test_init_layer_auto_leaves_an_mla_target_s_drafter_untouched(tiny_targets):
    """DeepSeek-V3's MLA attention has no q_proj of the drafter's shape: auto keeps the random
    layer, says why, and writes nothing (a half-copied layer would be worse than either)."""
    from specdec.train.drafter_init import start_layer

    target = tiny_targets["deepseek_v3"]
    cfg = DrafterConfig.for_target(target.config, draft_vocab_size=128, aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    said = start_layer(drafter, target, "auto")
    assert said.startswith("random (") and "does not fit" in said
    assert all(torch.equal(v, before[k]) for k, v in drafter.state_dict().items())


def test_walk_over_the_engine_s_own_text_measures_what_the_engine_measured(tiny_targets):
    """`walk_acceptance` over the text the engine generated, teacher-forced through TTT, gives the
    engine's own steps and accepted drafts; the per-position average over the same text does not
    (it counts the inside of long accepted runs as often as the positions after a miss)."""
    from collections import Counter

    from specdec.engine.engine import SpeculativeEngine
    from specdec.train.ttt import Batch, TargetHead, ttt_loss, walk_acceptance

    target = tiny_targets["llama"]
    k = 4
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    # A prompt the tiny target answers with runs of one token among others.
    prompt = torch.randint(3, target.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    text = SpeculativeEngine(target).generate(prompt, params).token_ids
    # A drafter that always drafts the text's commonest token x: every logit 0, so draft index 0, x.
    x = Counter(text).most_common(1)[0][0]
    size = min(128, target.vocab_size - x)
    drafter = Eagle3Drafter(DrafterConfig.for_target(target.config, draft_vocab_size=size,
                                                     aux_layer_ids=target.aux_layer_ids))
    with torch.no_grad():
        drafter.lm_head.weight.zero_()
    drafter.set_vocab_mapping(torch.arange(x, x + size))
    drafter.eval()
    steps = [s for s in SpeculativeEngine(target, drafter=drafter, k=k).generate_iter(prompt, params) if s.drafted]
    assert [t for s in SpeculativeEngine(target, drafter=drafter, k=k).generate_iter(prompt, params)
            for t in s.token_ids] == text
    accepted = [min(s.accepted, len(s.token_ids) - 1) for s in steps]  # the last step is cut at max_new_tokens
    assert len(set(accepted)) >= 3  # runs of x of several lengths, and misses

    ids = torch.tensor(prompt + text)
    with torch.no_grad():
        out = target.forward(ids[None], capture=True)
    mask = torch.zeros(len(ids), dtype=torch.uint8)
    mask[len(prompt):] = 1  # the generated tokens are the assistant's
    sample = {"input_ids": ids.int(), "loss_mask": mask, "aux_hidden": out.aux_hidden[0],
              "last_hidden": out.last_hidden[0]}
    with torch.no_grad():
        res = ttt_loss(drafter, Batch.collate([sample], "cpu"), TargetHead.from_target(target), steps=k, walk=True)
    tokens, walked = walk_acceptance(res.depth, res.starts, k)
    assert walked == len(steps) and tokens == len(text) - 1 == sum(accepted) + len(steps)
    per_position = 1 + float(res.correct.sum() / res.counted)
    assert abs(per_position - tokens / walked) > 0.05
    # Chains of 2 walked over the same unroll (k = 5 is read off training's 7 steps this way).
    short = [s for s in SpeculativeEngine(target, drafter=drafter, k=2).generate_iter(prompt, params) if s.drafted]
    assert walk_acceptance(res.depth, res.starts, 2)[1] == len(short) > len(steps)


@pytest.mark.parametrize("live_slots", [0, 2, 4])
def test_ttt_attention_is_attention_over_the_causal_prefix_and_the_live_step_keys(live_slots):
    """Query t attends to step 0's keys at positions <= t and to the live steps' own keys at t, as
    one softmax; grouped query heads share their key head. Checked against that attention written
    out position by position, in float64."""
    from specdec.models.drafter import ttt_attention

    g = torch.Generator().manual_seed(0)
    B, nh, kvh, T, S, hd = 2, 6, 2, 7, 4, 8
    q, k0, v0 = (torch.randn(B, n, T, hd, generator=g, dtype=torch.float64) for n in (nh, kvh, kvh))
    step_k, step_v = (torch.randn(B, kvh, T, S, hd, generator=g, dtype=torch.float64) for _ in range(2))
    live = torch.arange(S) < live_slots
    got = ttt_attention(q, k0, v0, step_k, step_v, live) if live_slots else ttt_attention(q, k0, v0)
    want = torch.empty_like(q)
    for b in range(B):
        for h in range(nh):
            kv = h // (nh // kvh)
            for t in range(T):
                keys = torch.cat([k0[b, kv, : t + 1], step_k[b, kv, t, live]])
                values = torch.cat([v0[b, kv, : t + 1], step_v[b, kv, t, live]])
                w = torch.softmax(keys @ q[b, h, t] / hd**0.5, -1)
                want[b, h, t] = w @ values
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
