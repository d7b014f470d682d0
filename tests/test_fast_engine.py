"""The fast path computes what HF computes: logits of the fused static-cache decoder equal the HF
model's (fp32, CPU, no compile, no graphs), and FastEngine's greedy output is token-identical to
the reference engine's, plain, n-gram, EAGLE-3 chain and tree, and compiled on the CPU. GPU-only
parts (CUDA graphs, timing) are exercised by benchmarks/*.py and skipped here without a GPU."""

import pytest
import torch

from dataclasses import replace

from specdec.engine.api import SamplingParams
from specdec.engine.config import FastConfig
from specdec.engine.engine import SpeculativeEngine
from specdec.engine.choice import cpu_compiler, make_engine
from specdec.engine.fast import FastEngine, _tree_mask
from specdec.engine.static_decoder import FastDecoder, causal_mask

from specdec.engine.static_layers import check_supported
from specdec.engine.tree import Draft, TreeConfig
from specdec.errors import SpecdecError
from tests.test_engine_lossless import OracleProposer, random_drafter

SHORT = FastConfig(max_len=64)
FAST_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def _prompt(n=11, seed=1):
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fast(target, config=FastConfig(require_cuda=False, max_len=128, prefill_chunk=8), **kw):
    return FastEngine(target, config=config, **kw)


COMPILED = FastConfig(require_cuda=False, max_len=128, prefill_chunk=8, compile=True)


@pytest.mark.parametrize("arch", FAST_ARCHS)
def test_logits_match_hf(tiny_targets, arch):
    target = tiny_targets[arch]
    prompt = _prompt(13)
    with torch.no_grad():
        ref = target.model(input_ids=torch.tensor([prompt])).logits[0]
    dec = FastDecoder(target.model, max_len=64, pad=32)
    dec.optimize(compile=False, cuda_graphs=False)
    # Prefill in chunks of 8 (the second chunk padded), then one more token through bucket 1.
    rows = []
    for start in range(0, len(prompt), 8):
        ids = prompt[start : start + 8]
        b = dec.step(ids, list(range(start, start + len(ids))), start, causal_mask(8), 8)
        rows.append(b.logits[: len(ids)].clone())
    got = torch.cat(rows)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()
    nxt = int(ref[-1].argmax())
    b = dec.step([nxt], [len(prompt)], len(prompt), causal_mask(1), 1)
    with torch.no_grad():
        ref2 = target.model(input_ids=torch.tensor([prompt + [nxt]])).logits[0, -1]
    assert torch.allclose(b.logits[0], ref2, atol=1e-4, rtol=1e-4)


def test_tree_step_matches_hf_per_branch(tiny_targets):
    """A tree step's node logits equal HF's logits for each root-to-node path."""
    target = tiny_targets["llama"]
    prompt = _prompt(9)
    dec = FastDecoder(target.model, max_len=64, pad=32)
    dec.optimize(compile=False, cuda_graphs=False)
    dec.step(prompt[:-1], list(range(len(prompt) - 1)), 0, causal_mask(8), 8)
    P = len(prompt) - 1
    tokens, parents = [5, 6, 7, 8], [-1, -1, 0, 1]  # two branches: 5->7 and 6->8
    draft = Draft(tokens=tokens, parents=parents)
    pos = [P] + [P + 1 + d for d in draft.depths()]
    b = dec.step([prompt[-1], *tokens], pos, P, _tree_mask(parents, 8), 8)
    for node, path in ((2, [5, 7]), (3, [6, 8])):
        with torch.no_grad():
            ref = target.model(input_ids=torch.tensor([prompt + path])).logits[0, -1]
        assert torch.allclose(b.logits[1 + node], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", FAST_ARCHS)
def test_greedy_identical_to_reference(tiny_targets, arch):
    target = tiny_targets[arch]
    prompt = _prompt()
    ref = SpeculativeEngine(target).generate(prompt, GREEDY).token_ids
    assert _fast(target).generate(prompt, GREEDY).token_ids == ref
    res = _fast(target, ngram=3, k=4).generate(prompt, GREEDY)
    assert res.token_ids == ref
    drafter = random_drafter(target)
    for k in (1, 4):
        assert _fast(target, drafter=drafter, k=k).generate(prompt, GREEDY).token_ids == ref
    tree = TreeConfig(depth=3, top_k=3, total_tokens=8)
    assert _fast(target, drafter=drafter, tree=tree).generate(prompt, GREEDY).token_ids == ref


def test_oracle_tree_compaction(tiny_targets):
    """Well-matched trees accept deep paths off the first child, exercising cache compaction."""
    target = tiny_targets["qwen2"]
    prompt = _prompt(7, seed=3)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ref = SpeculativeEngine(target).generate(prompt, params).token_ids
    for width in (1, 3):
        prop = OracleProposer(ref, len(prompt), seed=width, width=width)
        eng = _fast(target, proposer=prop, k=4, tree=TreeConfig(depth=4, top_k=3, total_tokens=12))
        res = eng.generate(prompt, params)
        assert res.token_ids == ref
        assert res.accepted > 0


def test_sampling_runs_and_is_seeded(tiny_targets):
    target = tiny_targets["llama"]
    params = SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    a = _fast(target, ngram=2, k=3).generate(_prompt(), params).token_ids
    b = _fast(target, ngram=2, k=3).generate(_prompt(), params).token_ids
    assert a == b and len(a) == 16


def test_stops_and_length_like_reference(tiny_targets):
    target = tiny_targets["mistral"]
    prompt = _prompt()
    ref = SpeculativeEngine(target).generate(prompt, GREEDY).token_ids
    stop = ref[5]
    params = SamplingParams(max_new_tokens=24, stop_token_ids=(stop,), ignore_eos=True)
    want = SpeculativeEngine(target, ngram=3, k=4).generate(prompt, params)
    got = _fast(target, ngram=3, k=4).generate(prompt, params)
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    with pytest.raises(SpecdecError, match="max_len"):
        _fast(target).generate(prompt, SamplingParams(max_new_tokens=500))


def test_refuses_unsupported(tiny_targets):
    with pytest.raises(SpecdecError, match="fast path supports"):
        check_supported(tiny_targets["deepseek_v3"].config)
    with pytest.raises(SpecdecError, match="CUDA"):
        FastEngine(tiny_targets["llama"])  # CPU target, require_cuda defaults to True
    # make_engine falls back to the reference engine for an fp32 CPU target or an unsupported arch.
    assert type(make_engine(tiny_targets["llama"], ngram=3, config=SHORT)) is SpeculativeEngine
    assert type(make_engine(tiny_targets["deepseek_v3"])) is SpeculativeEngine
    with pytest.raises(SpecdecError, match="does not apply"):
        make_engine(tiny_targets["llama"], fast=True)


def test_sliding_window_refused():
    from specdec.models.tiny import tiny_config

    cfg = tiny_config("mistral")
    cfg.sliding_window = 32
    with pytest.raises(SpecdecError, match="sliding-window"):
        check_supported(cfg, max_len=64)
    check_supported(cfg, max_len=32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_greedy_matches_reference_fp32(tiny_dirs):
    from transformers import AutoModelForCausalLM

    from specdec.models.target import Target

    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).cuda()
    target = Target(model, name="tiny-llama")
    prompt = _prompt()
    ref = SpeculativeEngine(target).generate(prompt, GREEDY).token_ids
    config = FastConfig(max_len=128, prefill_chunk=8)
    eng = FastEngine(target, ngram=3, k=4, config=config)
    assert eng.generate(prompt, GREEDY).token_ids == ref
    # Plain and chain steps on the device (CUDA events, pinned reads, a step queued past the end).
    stop = SamplingParams(max_new_tokens=24, stop_token_ids=(ref[6],), ignore_eos=True)
    for kw in ({}, {"drafter": random_drafter(target).cuda(), "k": 3}):
        eng = FastEngine(target, config=config, **kw)
        assert eng.generate(prompt, stop).token_ids == ref[: ref.index(ref[6]) + 1]
        assert eng.generate(prompt, GREEDY).token_ids == ref


@pytest.mark.skipif(cpu_compiler() is None, reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_on_cpu_identical_to_reference(tiny_targets):
    """The CPU fast path's inductor-compiled steps (fp32 here, where few-row products run as
    `weight @ x.T`) decode what the reference engine decodes, plain and with an EAGLE-3 chain."""
    target = tiny_targets["llama"]
    prompt = _prompt()
    ref = SpeculativeEngine(target).generate(prompt, GREEDY).token_ids
    plain = _fast(target, COMPILED)
    assert plain.fast.compiled
    assert plain.generate(prompt, GREEDY).token_ids == ref
    eagle = _fast(target, replace(COMPILED, static_drafter=False), drafter=random_drafter(target), k=3,
                  decoder=plain.fast)
    assert eagle.generate(prompt, GREEDY).token_ids == ref


def _bf16(target):
    import copy

    from specdec.models.target import Target

    return Target(copy.deepcopy(target.model).to(torch.bfloat16), target.tokenizer, name=target.name + "-bf16")


def test_make_engine_cpu_fast_path_choice(tiny_targets, monkeypatch):
    """On a CPU make_engine compiles the fast path for bf16 targets above a size threshold, keeps
    the reference engine for fp32, small targets or no C++ compiler, and falls back (with a
    warning) when compiling fails, unless fast=True asked for the fast path."""
    import specdec.engine.choice as fast_mod

    warmed = []
    monkeypatch.setattr(FastEngine, "warmup", lambda self: warmed.append(self) or 0.0)
    bf16 = _bf16(tiny_targets["llama"])
    assert type(make_engine(bf16, ngram=3, config=SHORT)) is SpeculativeEngine  # tiny: below the threshold
    assert "parameters" in fast_mod.cpu_fast_path_blocker(bf16)
    monkeypatch.setattr(fast_mod, "CPU_FAST_MIN_PARAMS", 0)
    eng = make_engine(bf16, drafter=random_drafter(tiny_targets["llama"]).to(torch.bfloat16), k=2, config=SHORT)
    assert type(eng) is FastEngine and eng.fast.compiled and eng.static is None and warmed == [eng]
    assert type(make_engine(tiny_targets["llama"], config=SHORT)) is SpeculativeEngine  # fp32
    with monkeypatch.context() as m:
        m.setattr(fast_mod.shutil, "which", lambda name: None)
        assert "C++ compiler" in fast_mod.cpu_fast_path_blocker(bf16)
        assert type(make_engine(bf16, config=SHORT)) is SpeculativeEngine

    def broken(self):
        raise RuntimeError("InductorError: no cpp compiler")

    monkeypatch.setattr(FastEngine, "warmup", broken)
    with pytest.warns(UserWarning, match="CPU fast path failed to compile"):
        assert type(make_engine(bf16, ngram=3, config=SHORT)) is SpeculativeEngine
    with pytest.raises(RuntimeError, match="no cpp compiler"):
        make_engine(bf16, fast=True, config=SHORT)


@pytest.mark.parametrize("k", (0, 3))
def test_device_steps_queue_ahead_and_end_exactly(tiny_targets, k):
    """Greedy plain (k = 0) and chain steps advance their input on the device and queue step n + 1
    before the host reads step n: the output still equals the reference at every length and at a
    stop token, and a step queued past the end leaves nothing behind for the next request."""
    target = tiny_targets["llama"]
    kw = {} if k == 0 else {"drafter": random_drafter(target), "k": k}
    engine = _fast(target, **kw)
    prompt, other = _prompt(), _prompt(9, seed=5)
    ref = SpeculativeEngine(target).generate(prompt, GREEDY).token_ids
    verifies = []
    run = engine.fast.run

    def counted(b, capture=False):
        verifies.append(b.T == k + 1)
        run(b, capture)

    engine.fast.run = counted
    events = []
    for step in engine.generate_iter(prompt, GREEDY):
        events.append((sum(verifies), len(step.token_ids)))
    assert [t for out in engine.generate_iter(prompt, GREEDY) for t in out.token_ids] == ref
    # Before the host saw step n (the first output is the prefill's), step n + 1 was queued,
    # except where step n could reach max_new_tokens.
    produced = events[0][1]
    for n, (runs, got) in enumerate(events[1:]):
        if produced + k + 1 < GREEDY.max_new_tokens:
            assert runs == n + 2
        produced += got
    for max_new in (1, 2, k + 1, k + 2, 2 * k + 3):
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        assert engine.generate(prompt, params).token_ids == ref[:max_new]
    stop = ref[4]
    got = engine.generate(prompt, SamplingParams(max_new_tokens=24, stop_token_ids=(stop,), ignore_eos=True))
    assert got.token_ids == ref[: ref.index(stop) + 1] and got.finish_reason == "stop"
    assert engine.generate(other, GREEDY).token_ids == SpeculativeEngine(target).generate(other, GREEDY).token_ids
