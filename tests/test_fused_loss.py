"""The fused soft cross-entropy (train/fused_loss.py) against the PyTorch one it replaces, run by
Triton's interpreter on CPU tensors where there is no GPU (conftest sets TRITON_INTERPRET=1): the
loss and its gradient on the strided views the TTT unroll passes, then whole training runs."""

import pytest
import torch

from specdec.capture.store import CaptureStore
from specdec.models.target import load_target
from specdec.train import fused_loss
from specdec.train.data import OfflineSource
from specdec.train.loop import TrainConfig, train
from specdec.train.ttt import soft_cross_entropy

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not fused_loss.available(DEV),
                                reason="needs Triton (the dev extra installs it), interpreted or on a GPU")


def _views(V: int, dtype, seed: int, normalized: bool = True):
    """A step's inputs as ttt_loss slices them: logits[:, :n] of [B, L, V], p[:, 1 + s : 1 + s + n]
    of [B, L, V] (rows strided, not contiguous), a 0/1 weight [B, n] with some rows off."""
    g = torch.Generator().manual_seed(seed)
    B, L, s = 3, 9, 2
    n = L - 2 - s
    logits = (3 * torch.randn(B, L, V, generator=g)).to(DEV, dtype).requires_grad_(True)
    raw = torch.randn(B, L, V, generator=g)
    p = torch.softmax(2 * raw, -1) if normalized else raw.abs() / V  # rows need not sum to 1
    weight = (torch.rand(B, n, generator=g) > 0.3).float().to(DEV)
    return logits, logits[:, :n], p.to(DEV)[:, 1 + s : 1 + s + n], weight


@pytest.mark.parametrize("V", [300, 2500])  # one partial block; two blocks, the second partial
@pytest.mark.parametrize("normalized", [True, False])
def test_fused_loss_and_gradient_equal_the_pytorch_ones_in_fp32(V, normalized):
    got, want = [], []
    for fn, out in ((fused_loss.fused_soft_cross_entropy, got), (soft_cross_entropy, want)):
        full, x, p, w = _views(V, torch.float32, seed=V, normalized=normalized)
        assert not x.is_contiguous() and not p.is_contiguous()
        loss = fn(x, p, w)
        loss.backward()
        out += [loss.detach(), full.grad]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-7)
    assert got[1][:, -2:].abs().max() == 0  # positions past n get no gradient
    assert got[1].abs().max() > 0


def test_fused_loss_reads_bf16_logits_and_returns_a_bf16_gradient():
    """As under the training's autocast: bf16 logits read in fp32, the gradient rounded once to
    bf16 (the interpreter truncates where the GPU rounds: within one bf16 step either way)."""
    got, want = [], []
    for fn, out in ((fused_loss.fused_soft_cross_entropy, got), (soft_cross_entropy, want)):
        full, x, p, w = _views(1000, torch.bfloat16, seed=7)
        fn(x, p, w).backward()
        out.append(full.grad)
    assert got[0].dtype == torch.bfloat16
    scale = want[0].float().abs().max().item()
    assert (got[0].float() - want[0].float()).abs().max().item() <= 2 * 2.0**-7 * scale


def test_training_with_the_fused_loss_trains_as_the_pytorch_loss(tiny_dirs, tmp_path):
    """`fused_loss` wired into train(): the same steps reach the same loss and weights (fp32); on a
    GPU with the fused run's steps recorded as CUDA graphs, where its kernels are replayed."""
    from safetensors.torch import load_file

    from specdec.capture.run import load_records, run_capture
    from specdec.data.datasets import Conversation
    from specdec.data.regenerate import RegenConfig, regenerate_local

    target = load_target(str(tiny_dirs["llama"]), device=DEV)
    convs = [Conversation(id=f"q{i}", messages=[{"role": "user", "content": f"count to {i} in words"}])
             for i in range(12)]
    regenerate_local(target, convs, tmp_path / "regen.jsonl", RegenConfig(max_new_tokens=24), batch_size=6,
                     progress=False)
    run_capture(target, load_records(str(tmp_path / "regen.jsonl")), tmp_path / "cap", dtype=torch.float32,
                progress=False, check_space=False)
    source = OfflineSource(CaptureStore(tmp_path / "cap"))
    runs = {}
    for name, fused in (("pytorch", False), ("fused", True)):
        c = TrainConfig(out=str(tmp_path / name), max_steps=3, draft_vocab_size=64, batch_tokens=256, ttt_steps=2,
                        lr=3e-3, eval_every=10_000, bf16=False, fused_loss=fused, length_multiple=64,
                        cuda_graphs=fused and DEV == "cuda")
        runs[name] = train(target, source, c, progress=False)
    assert runs["fused"]["fused_loss"] and not runs["pytorch"]["fused_loss"]
    assert runs["fused"]["last_loss"] == pytest.approx(runs["pytorch"]["last_loss"], rel=1e-5)
    a, b = (load_file(str(tmp_path / name / "drafter" / "model.safetensors")) for name in ("pytorch", "fused"))
    for k in a:
        # AdamW's first steps move each weight by about lr whatever its gradient's size, so a
        # near-zero gradient that the two sum apart moves apart: the CUDA graph test's tolerance.
        torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-4, msg=k)
