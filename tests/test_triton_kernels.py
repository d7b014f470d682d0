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
from specdec.engine.fast import FastDecoder, _causal

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
    _close(gemv.gemv(x, w)[0], want, want.abs().max())
    normed = xf * torch.rsqrt(xf.pow(2).mean() + 1e-5) * g.float()
    want = wf @ normed
    _close(gemv.gemv_rms(x, g, w, 1e-5)[0], want, want.abs().max())
    want = rf + wf @ xf
    _close(gemv.gemv_add(x, w, r)[0], want, want.abs().max())
    wgu = _randn(2 * n, k, seed=5)  # [gate; up]
    gate, up = (wgu.float() @ normed).chunk(2)
    want = F.silu(gate) * up
    _close(gemv.gemv_rms_glu(x, g, wgu, 1e-5)[0], want, want.abs().max())


# (query heads, kv heads, head size, cache slots, the token's slot): GQA groups of 2, 3 (not a power
# of two, SmolLM2's) and 4 (Llama-3's); the first and the last slot; a cache that does not divide
# into the kernel's blocks.
@pytest.mark.parametrize("nh,nkv,hd,S,slot", [(4, 2, 16, 96, 37), (9, 3, 64, 128, 0), (9, 3, 64, 128, 127),
                                              (8, 2, 32, 70, 45)])
def test_decode_attention_matches_softmax_attention(nh, nkv, hd, S, slot):
    q = _randn(nh, hd, seed=slot)
    kc, vc = _randn(nkv, S, hd, seed=10), _randn(nkv, S, hd, seed=11)
    # Slots past the token's hold garbage a kernel must not read (NaN would spread).
    kc[:, slot + 1 :], vc[:, slot + 1 :] = float("nan"), float("nan")
    keys = kc[:, : slot + 1].float().cpu().repeat_interleave(nh // nkv, 0)
    vals = vc[:, : slot + 1].float().cpu().repeat_interleave(nh // nkv, 0)
    p = torch.softmax(q.float().cpu()[:, None, :] @ keys.transpose(1, 2) / math.sqrt(hd), dim=-1)
    want = (p @ vals).reshape(1, -1)
    out = decode_attention.decode_attention(q, kc, vc, torch.tensor([slot], device=DEV), hd**-0.5)
    _close(out, want, 1.0)
    assert torch.isnan(kc[:, slot + 1 :]).all() and torch.isnan(vc[:, slot + 1 :]).all()  # untouched


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: a q/k/v bias after the fused product
def test_one_token_steps_through_the_kernels_match_hf(tiny_targets, arch, monkeypatch):
    """Decode steps of one token run every fused kernel: norms, residual adds and SiLU * up folded
    into the products, attention in decode_attention. Four steps in a row, so a key or value cached
    in the wrong slot shows in the next step."""
    model = copy.deepcopy(tiny_targets[arch].model).to(DEV, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norm weights of their own (a fresh model's are all ones)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    prompt = torch.randint(0, 250, (9,), generator=gen).tolist()
    fused = FastDecoder(model, max_len=64, pad=32).optimize(compile=False, cuda_graphs=False, gemv=True)
    calls = {"attention": 0, "glu": 0}
    for mod, name, key in ((decode_attention, "decode_attention", "attention"), (gemv, "gemv_rms_glu", "glu")):

        def counted(*a, real=getattr(mod, name), key=key):
            calls[key] += 1
            return real(*a)

        monkeypatch.setattr(mod, name, counted)
    ids = list(prompt)
    fused.step(prompt[:8], list(range(8)), 0, _causal(8), 8)
    assert calls == {"attention": 0, "glu": 0}  # 8 rows: the unfused path
    layers = model.config.num_hidden_layers
    for t in range(8, 12):
        got = fused.step([ids[t]], [t], t, _causal(1), 1).logits[0].float().cpu()
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([ids[: t + 1]], device=DEV)).logits[0, -1].float().cpu()
        assert calls == {"attention": layers * (t - 7), "glu": layers * (t - 7)}
        # bf16 through 4 layers (and the interpreter's truncation): ~1.1% from HF; a norm weight or a
        # residual wired wrong is ~50% off.
        assert (got - ref).norm() <= 0.03 * ref.norm()
        ids.append(int(ref.argmax()))
