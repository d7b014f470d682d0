"""The CUDA fast path's Triton kernels (engine/gemv.py, engine/decode_attention.py), run by Triton's
interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1 where there is no GPU): the kernel
bodies against plain PyTorch math, then a whole one-token step through them against HF.

The interpreter converts fp32 to bf16 by truncation where the GPU rounds to nearest, so values
that pass through bf16 are compared to within one bf16 step."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from specdec.engine import decode_attention, gemv
from specdec.engine.config import KernelConfig
from specdec.engine.static_decoder import FastDecoder, causal_mask


pytestmark = pytest.mark.skipif(gemv.triton is None or not (gemv.INTERPRETED or torch.cuda.is_available()),
                                reason="needs Triton (the dev extra installs it), interpreted or on a GPU")
BF16_STEP = 2.0**-7  # relative spacing of bf16 values
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, torch.bfloat16)


def _close(got, want, scale):
    """Within bf16 rounding of values of magnitude `scale` (two steps: the kernel's and ours)."""
    err = (got.float().cpu() - want.float().cpu()).abs().max().item()
    assert err <= 2 * BF16_STEP * scale, f"max error {err:.4g} over values of magnitude {scale:.3g}"


@pytest.mark.parametrize("n,k", [(40, 96), (259, 64), (7, 200)])  # rows and columns off the block sizes
def test_gemv_variants_match_torch(n, k):
    x, w, r = _randn(k, seed=1), _randn(n, k, seed=2), _randn(n, seed=3)
    g = _randn(k, seed=4).abs() + 0.5
    xf, wf, rf = x.float(), w.float(), r.float()
    want = wf @ xf
    _close(gemv.gemv(x, w, True)[0], want, want.abs().max())
    normed = xf * torch.rsqrt(xf.pow(2).mean() + 1e-5) * g.float()
    want = wf @ normed
    _close(gemv.gemv_rms(x, g, w, 1e-5, True)[0], want, want.abs().max())
    want = rf + wf @ xf
    _close(gemv.gemv_add(x, w, r, True)[0], want, want.abs().max())
    wgu = _randn(2 * n, k, seed=5)  # [gate; up]
    gate, up = (wgu.float() @ normed).chunk(2)
    want = F.silu(gate) * up
    _close(gemv.gemv_rms_glu(x, g, wgu, 1e-5)[0], want, want.abs().max())


@pytest.mark.parametrize("t,n,k", [(2, 40, 96), (5, 259, 64), (16, 33, 200)])  # off the block sizes
def test_rows_kernel_matches_torch(t, n, k):
    """Steps of 2..rows_max tokens: the same ops over T rows run the rows kernel."""
    x, w, b = _randn(t, k, seed=6), _randn(n, k, seed=7), _randn(n, seed=8)
    want = x.float() @ w.float().T
    _close(gemv.gemv(x, w, True), want, want.abs().max())
    r, g = _randn(t, n, seed=9), _randn(k, seed=4).abs() + 0.5
    _close(gemv.gemv_add(x, w, r, True), want + r.float(), want.abs().max())
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * g.float()  # each row on its own
    want_normed = normed @ w.float().T
    _close(gemv.gemv_rms(x, g, w, 1e-5, True), want_normed, want_normed.abs().max())
    # gemv_linear sends 2..rows_max rows of any leading shape there, the bias added after
    assert gemv.few_rows(x, w, KernelConfig()) and not gemv.few_rows(x, w, KernelConfig(rows_max=t - 1))
    want = want + b.float()
    _close(gemv.gemv_linear(x.view(1, t, k), w, b, KernelConfig())[0], want, want.abs().max())


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# A tree of 5 tokens: 0 the root, 1 and 2 its children, 3 under 1, 4 under 2 (each sees its ancestors).
TREE = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]])


# (query heads, kv heads, head size, cache slots, the step's first slot, its tree mask): GQA groups
# of 2, 3 (not a power of two, SmolLM2's) and 4 (Llama-3's); one token at the first and at the
# last slot; a cache that does not divide into the kernel's blocks; chains of 8 tokens (32 rows,
# a verify step on Llama-3 shapes) across a block boundary (of 32, and of 32, 64 and 128); a tree.
@pytest.mark.parametrize("nh,nkv,hd,S,slot0,tm", [
    (4, 2, 16, 96, 37, torch.ones(1, 1)), (9, 3, 64, 128, 0, torch.ones(1, 1)),
    (9, 3, 64, 128, 127, torch.ones(1, 1)), (8, 2, 32, 70, 45, torch.ones(1, 1)),
    (8, 2, 32, 96, 27, torch.ones(8, 8).tril()), (8, 2, 32, 160, 124, torch.ones(8, 8).tril()),
    (9, 3, 64, 128, 60, TREE), (4, 2, 16, 64, 0, TREE),
])
def test_step_attention_matches_softmax_attention(nh, nkv, hd, S, slot0, tm, kernels=KernelConfig()):
    T = tm.shape[0]
    qkv = _randn(T, (nh + 2 * nkv) * hd, seed=slot0)  # the kernel reads (and ropes) the queries only
    angle = torch.arange(slot0, slot0 + T)[:, None] * 10000.0 ** (-torch.arange(0, hd, 2) / hd)
    cos, sin = (f(torch.cat((angle, angle), -1)).to(DEV, torch.bfloat16) for f in (torch.cos, torch.sin))
    kv = _randn(2, nkv, S, hd, seed=10)
    # Slots past the step's hold garbage a kernel must not read (NaN would spread).
    kv[:, :, slot0 + T :] = float("nan")
    q = qkv[:, : nh * hd].view(T, nh, hd)
    q = (q * cos[:, None] + _rotate_half(q) * sin[:, None]).float().cpu()  # HF's rope, in bf16
    keys, vals = (c[:, : slot0 + T].float().cpu().repeat_interleave(nh // nkv, 0) for c in kv)
    scores = torch.einsum("thd,hsd->ths", q, keys) / math.sqrt(hd)  # shape: [T, nh, slots]
    seen = torch.cat((torch.ones(T, slot0, dtype=torch.bool), tm != 0), dim=1)
    p = torch.softmax(scores.masked_fill(~seen[:, None], float("-inf")), dim=-1)
    want = torch.einsum("ths,hsd->thd", p, vals).reshape(T, nh * hd)
    out = decode_attention.decode_attention(qkv, cos, sin, kv, torch.arange(slot0, slot0 + T, device=DEV),
                                            tm.to(DEV, torch.int64), nh, hd**-0.5,
                                            *decode_attention.settings(kernels, T))
    _close(out, want, want.abs().max())  # a mask that lets a token see later ones is ~0.3-1 off
    assert torch.isnan(kv[:, :, slot0 + T :]).all()  # untouched


@pytest.mark.parametrize("block", [64, 128])
def test_step_attention_with_larger_blocks_for_steps(block):
    # Steps of more than one token split the cache into blocks of their own (benchmarks' sbs=N).
    kernels = KernelConfig(attention_step_block=block)
    assert decode_attention.settings(kernels, 8)[0] == block and decode_attention.settings(kernels, 1)[0] == 32
    test_step_attention_matches_softmax_attention(8, 2, 32, 160, 124, torch.ones(8, 8).tril(), kernels)
    test_step_attention_matches_softmax_attention(9, 3, 64, 192, 60, TREE, kernels)


def test_kernel_steps_build_configs_and_tag_results():
    # A benchmark plan's setting steps make a new config for the variants after them (no module
    # constant changes) and tag their results while they differ from the shipped settings.
    from specdec.bench.roofline import kernel_step

    shipped, tags = KernelConfig(), {}
    wide = kernel_step("sbs=64", shipped, tags)
    assert wide.attention_step_block == 64 and shipped.attention_step_block == 32 and tags == {"sbs": "@sbs64"}
    assert kernel_step("glu=0", wide, tags).glu_fold_max_bytes == 0 and tags["glu"] == "@glu0"
    back = kernel_step("sbs=32", wide, tags)
    assert back == shipped and tags["sbs"] == ""
    assert kernel_step("check", shipped, tags) is None and kernel_step("nope=1", shipped, tags) is None
    # Values a kernel cannot take are refused where the config is built.
    from specdec.errors import SpecdecError

    for step in ("rows=17", "sbs=48", "bs=8"):
        with pytest.raises(SpecdecError, match="rows_max|power of two"):
            kernel_step(step, shipped, tags)


def test_split_argmax_matches_argmax():
    from specdec.engine.static_layers import split_argmax

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 517] = logits[1, 901] = 10.0  # a tie: the first index wins, as with argmax
    logits[2, 999] = 10.0  # in the padded last chunk
    assert split_argmax(logits, chunks=64).tolist() == logits.argmax(-1).tolist() == [logits[0].argmax(), 517, 999]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a q/k/v bias after the fused product
def test_steps_through_the_kernels_match_hf(tiny_targets, arch, monkeypatch):
    """Decode steps of one token run every fused kernel: norms, residual adds and SiLU * up folded
    into the products, attention in decode_attention; a prefill of 8 tokens and a verify step of 3
    run the attention kernels and the rows kernel. Steps in a row, so a key or value cached in the
    wrong slot shows in the next step."""
    model = copy.deepcopy(tiny_targets[arch].model).to(DEV, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norm weights of their own (a fresh model's are all ones)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    ids = torch.randint(0, 250, (8,), generator=gen).tolist()
    with torch.no_grad():  # HF's greedy continuation, and its logits at every position
        seq = model.generate(torch.tensor([ids], device=DEV), max_new_tokens=7, do_sample=False)
        ref = model(input_ids=seq).logits[0].float().cpu()
    ids = seq[0].tolist()
    fused = FastDecoder(model, max_len=64, pad=32).optimize(compile=False, cuda_graphs=False, gemv=True)
    calls = {"attention": 0, "glu": 0, "rows": 0}  # "rows": folded products over more than one row
    for mod, name, key in ((decode_attention, "decode_attention", "attention"), (gemv, "gemv_rms_glu", "glu"),
                           (gemv, "gemv_rms", "rows"), (gemv, "gemv_add", "rows")):

        def counted(*a, real=getattr(mod, name), key=key):
            calls[key] += key != "rows" or a[0].numel() > a[0].shape[-1]
            return real(*a)

        monkeypatch.setattr(mod, name, counted)
    layers = model.config.num_hidden_layers

    def check(got, want):
        # bf16 through 4 layers (and the interpreter's truncation): ~1.1% from HF; a norm weight, a
        # residual or a mask wired wrong is ~50% off.
        for g, w in zip(got.float().cpu(), want):
            assert (g - w).norm() <= 0.03 * w.norm()

    check(fused.step(ids[:8], list(range(8)), 0, causal_mask(8), 8).logits, ref[:8])
    products = layers * 4 + 1  # q/k/v, o, gate/up and down in every layer, then the lm head
    assert calls == {"attention": layers, "glu": 0, "rows": products}  # 8 rows: attention kernels, rows kernel
    for t in range(8, 12):
        check(fused.step([ids[t]], [t], t, causal_mask(1), 1).logits, ref[t : t + 1])
        assert calls == {"attention": layers * (t - 6), "glu": layers * (t - 7), "rows": products}
    check(fused.step(ids[12:15], [12, 13, 14], 12, causal_mask(3), 3).logits, ref[12:15])  # a verify step
    assert calls == {"attention": layers * 6, "glu": layers * 4, "rows": 2 * products}
    # A tree of 5 (TREE) after the 15 tokens: against the decoder without the kernels (the compiled
    # attention's additive mask), filled with the same 15 tokens.
    plain = FastDecoder(model, max_len=64, pad=32).optimize(compile=False, cuda_graphs=False, gemv=False)
    plain.step(ids[:15], list(range(15)), 0, causal_mask(15), 15)
    tree, pos = [3, 17, 40, 99, 7], [15, 16, 16, 17, 17]
    want = plain.step(tree, pos, 15, TREE.numpy(), 5).logits.float().cpu()
    check(fused.step(tree, pos, 15, TREE.numpy(), 5).logits, want)
    assert calls["attention"] == layers * 7


def test_engine_trees_through_the_kernels(tiny_targets, monkeypatch):
    """FastEngine's speculative steps through the kernels: oracle trees of 12 drafted tokens (the
    rows kernel, the attention kernels under tree masks, then cache compaction) give the plain
    greedy output of the same kernels, token for token."""
    from specdec.engine.api import SamplingParams
    from specdec.engine.config import FastConfig
    from specdec.engine.fast import FastEngine
    from specdec.engine.tree import TreeConfig
    from specdec.models.target import Target
    from tests.test_engine_lossless import OracleProposer

    base = tiny_targets["qwen2"]
    target = Target(copy.deepcopy(base.model).to(DEV, torch.bfloat16), base.tokenizer, name="tiny-qwen2-bf16")
    prompt = torch.randint(0, 250, (7,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)

    def engine(**kw):
        eng = FastEngine(target, config=FastConfig(require_cuda=False, compile=False, max_len=64, prefill_chunk=8),
                         **kw)
        eng.fast.optimize(compile=False, cuda_graphs=False, gemv=True)
        return eng

    ref = engine().generate(prompt, params).token_ids
    sizes = []  # tokens per step that ran the attention kernels

    def counted(qkv, *a, real=decode_attention.decode_attention):
        sizes.append(qkv.shape[0])
        return real(qkv, *a)

    monkeypatch.setattr(decode_attention, "decode_attention", counted)
    tree = TreeConfig(depth=4, top_k=3, total_tokens=12)
    res = engine(proposer=OracleProposer(ref, len(prompt), seed=3, width=3), k=4, tree=tree).generate(prompt, params)
    assert res.token_ids == ref
    assert res.accepted > 0 and 13 in sizes  # the tree steps (12 drafted + 1) ran the kernels


@pytest.mark.parametrize("t", [1, 5])  # the one-token GEMV and the rows kernel
def test_packed_weights_match_row_major(t):
    """A weight packed into contiguous blocks (gemv.pack) gives the products of the row-major one,
    norms and residual adds folded in; steps of more rows than the kernels take unpack it."""
    n, k, layout = 48, 128, (16, 32)
    x, w, r = _randn(t, k, seed=11), _randn(n, k, seed=12), _randn(t, n, seed=13)
    g = _randn(k, seed=14).abs() + 0.5
    p = gemv.pack(w, layout)
    assert p.shape == (3, 4, 16, 32) and torch.equal(gemv.unpack(p), w)
    assert (gemv.out_features(p), gemv.in_features(p)) == (n, k)
    xf = x.float()
    want = xf @ w.float().T
    _close(gemv.gemv(x, p, True), want, want.abs().max())
    _close(gemv.gemv_add(x, p, r, True), want + r.float(), want.abs().max())
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * g.float()
    want = normed @ w.float().T
    _close(gemv.gemv_rms(x, g, p, 1e-5, True), want, want.abs().max())
    kernels = KernelConfig()
    many = _randn(kernels.rows_max + 3, k, seed=15)
    want = many.float() @ w.float().T
    assert not gemv.few_rows(many, p, kernels)
    _close(gemv.gemv_linear(many, p, None, kernels), want, want.abs().max())


def test_pack_layout_by_size_and_shape():
    least = KernelConfig().pack_min_bytes
    assert gemv.pack_layout(28672, 4096, 235 << 20, least) == (128, 256)  # Llama-3.1-8B's gate/up
    assert gemv.pack_layout(4096, 14336, 117 << 20, least) == (32, 512)  # its down
    assert gemv.pack_layout(6144, 4096, 50 << 20, least) == (64, 256)  # its q/k/v
    assert gemv.pack_layout(1152, 576, 1 << 20, least) is None  # SmolLM2's: under the size
    assert gemv.pack_layout(1152, 576, 1 << 20, 1 << 20) is None  # blocks that do not divide it
    assert gemv.pack_layout(6144, 4000, 50 << 20, least) is None


def test_steps_with_packed_weights_match_row_major(tiny_targets, monkeypatch):
    """FastDecoder.optimize packs the products' weights where pack_layout says so, into new tensors
    (the model's own stay row-major): steps of 1 and 3 tokens give the row-major decoder's logits,
    and a step of more tokens than the kernels take reads the row-major weights, unpacking none."""
    from specdec.engine import static_layers

    model = copy.deepcopy(tiny_targets["llama"].model).to(DEV, torch.bfloat16)
    wide = KernelConfig().rows_max + 2
    ids = torch.randint(0, 250, (12 + wide,), generator=torch.Generator().manual_seed(5)).tolist()
    unpacked = []
    unpack = gemv.unpack
    monkeypatch.setattr(gemv, "unpack", lambda w: unpacked.append(w.dim()) or unpack(w))
    row_major = FastDecoder(model, max_len=64, pad=32).optimize(compile=False, cuda_graphs=False, gemv=True)
    before = [p.clone() for p in model.parameters()]
    monkeypatch.setattr(static_layers, "pack_layout",
                        lambda n, k, nbytes, least: (16, 32) if n % 16 == 0 and k % 32 == 0 else None)
    # Off unless asked (a second copy of the weights).
    assert not KernelConfig().pack_weights
    off = FastDecoder(model, max_len=64, pad=32).optimize(compile=False, cuda_graphs=False, gemv=True)
    assert all(a.dim() < 4 for args in off._layer_args for a in args if a is not None)
    packed = FastDecoder(model, max_len=64, pad=32).optimize(compile=False, cuda_graphs=False, gemv=True,
                                                             kernel_config=KernelConfig(pack_weights=True))
    assert sum(a.dim() == 4 for args in packed._layer_args for a in args if a is not None) == 4 * len(packed.layers)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    for dec in (row_major, packed):
        dec.step(ids[:8], list(range(8)), 0, causal_mask(8), 8)
    for ts in ([8], [9, 10, 11], list(range(12, 12 + wide))):
        T = len(ts)
        want = row_major.step([ids[t] for t in ts], ts, ts[0], causal_mask(T), T).logits.float().cpu()
        got = packed.step([ids[t] for t in ts], ts, ts[0], causal_mask(T), T).logits.float().cpu()
        assert (got - want).norm() <= 0.01 * want.norm()
    assert 4 not in unpacked


@pytest.mark.parametrize("k", [1, 4])
def test_drafter_chain_through_the_kernels_matches_the_modules(tiny_targets, k, monkeypatch):
    """StaticChainDrafter with its layer on the kernels (eagle_kernels.py) against the same drafter
    on its modules: the same drafts and logits within bf16, round after round, for commits of every
    size from 1 to k + 1 (rows kernel, decode_attention over T rows) and one-token drafts (GEMV,
    folded SiLU * up); a cached key in the wrong slot or a wrong norm shows in the next round
    (relative logit error ~0.1% here against ~50% for such a fault)."""
    from specdec.engine.eagle_graph import StaticChainDrafter
    from specdec.engine.eagle_kernels import applies
    from tests.test_eagle_graph import sharp_drafter

    target = tiny_targets["llama"]
    # fp16: 8x finer than bf16, so the kernels' rounding (and the interpreter's truncation) stays
    # off the near-ties a sharp drafter still has deep in a chain.
    drafter = copy.deepcopy(sharp_drafter(target, seed=3)).to(DEV, torch.float16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norm weights of their own (a fresh drafter's are all ones)
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    assert applies(drafter, k + 1, KernelConfig())
    # The kernels compute SiLU: a drafter with another MLP activation stays on its own modules.
    gelu = copy.deepcopy(drafter)
    gelu.cfg.hidden_act = "gelu_pytorch_tanh"
    assert not applies(gelu, k + 1, KernelConfig())
    calls = {"attention": 0}

    def counted(*a, real=decode_attention.decode_attention):
        calls["attention"] += 1
        return real(*a)

    monkeypatch.setattr(decode_attention, "decode_attention", counted)
    fused = StaticChainDrafter(drafter, k=k, max_len=64, cuda_graphs=False, kernels=True)
    plain = StaticChainDrafter(drafter, k=k, max_len=64, cuda_graphs=False, kernels=False)
    width = len(target.aux_layer_ids) * target.hidden_size

    def inputs(n):
        return _randn(n, width, seed=int(torch.randint(0, 1 << 30, (), generator=gen))).half(), \
            torch.randint(0, target.vocab_size, (n,), generator=gen).to(DEV)

    # k = 1: a prompt longer than k + 1, whose first commit runs the modules on both; k = 4: one
    # that the kernels commit
    m = 9 if k == 1 else 3
    aux, ids = inputs(m)
    fused.start(aux, ids)
    plain.start(aux, ids)
    assert calls["attention"] == (m <= k + 1)
    for round_ in range(2 * (k + 1)):
        a, b = plain.propose(), fused.propose()
        assert b.tokens == a.tokens, f"round {round_}"
        got, want = fused.logits.float().cpu(), plain.logits.float().cpu()
        assert (got - want).norm() <= 0.005 * want.norm()
        aux, ids = inputs(1 + round_ % (k + 1))
        fused.commit(aux, ids)
        plain.commit(aux, ids)
    assert calls["attention"] == (m <= k + 1) + 2 * (k + 1) * k  # per round: the commit and k - 1 drafts
    assert int(fused.length) == int(plain.length) == m + sum(1 + r % (k + 1) for r in range(2 * (k + 1)))
