"""Drafter training: learning happens, checkpoints resume exactly after kill -9 (also across a
change of world size), a vocab mapping survives --init, and DDP runs with gloo on 2 processes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdec.capture.run import run_capture
from specdec.capture.store import CaptureStore
from specdec.engine.api import SamplingParams
from specdec.engine.engine import SpeculativeEngine
from specdec.models.formats import load_drafter
from specdec.models.target import load_target
from specdec.precision import compute_dtype, dtype_name
from specdec.train.data import OfflineSource
from specdec.train.loop import TrainConfig, train

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def records(n, seed=0, words=("alpha", "beta", "gamma", "delta")):
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        answer = " ".join(rng.choice(words) for _ in range(30))
        out.append({"id": f"s{seed}-{i}", "messages": [{"role": "user", "content": f"say words {i}"},
                                                        {"role": "assistant", "content": answer}]})
    return out


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return str(tiny_dirs["llama"])


@pytest.fixture(scope="module")
def capture_dir(tiny, tmp_path_factory):
    """The real pipeline in small: the target answers 24 prompts, then its states are captured."""
    from specdec.capture.run import load_records
    from specdec.data.datasets import Conversation
    from specdec.data.regenerate import RegenConfig, regenerate_local

    d = tmp_path_factory.mktemp("cap")
    target = load_target(tiny, device="cpu")
    convs = [Conversation(id=r["id"], messages=r["messages"][:1]) for r in records(24)]
    regenerate_local(target, convs, d / "regen.jsonl", RegenConfig(max_new_tokens=40), batch_size=8, progress=False)
    run_capture(target, load_records(str(d / "regen.jsonl")), d / "cap", dtype=torch.float32, progress=False,
                check_space=False)
    return d / "cap"


def train_cmd(tiny, data, out, *extra):
    return [sys.executable, "-m", "specdec", "train", "--target", tiny, "--data", str(data), "-o", str(out),
            "--draft-vocab-size", "64", "--batch-tokens", "1024", "--ttt-steps", "3", "--eval-every", "1000",
            "--lr", "3e-3", *extra]


def test_training_learns_and_the_drafter_is_lossless(tiny, capture_dir, tmp_path):
    target = load_target(tiny, device="cpu")
    cfg = TrainConfig(out=str(tmp_path / "run"), epochs=12, draft_vocab_size=64, batch_tokens=1024, ttt_steps=3,
                      lr=3e-3, eval_every=10_000, eval_percent=10)
    summary = train(target, OfflineSource(CaptureStore(capture_dir)), cfg, progress=False)
    hist = summary["eval"]
    assert hist["simulated_acceptance_length"] > 1.3  # a repetitive corpus is easy to draft
    drafter = load_drafter(tmp_path / "run" / "drafter", target)
    prompt = target.tokenizer("<|im_start|>assistant\nalpha beta")["input_ids"]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ref = SpeculativeEngine(target).generate(prompt, params)
    out = SpeculativeEngine(target, drafter=drafter, k=3).generate(prompt, params)
    assert out.token_ids == ref.token_ids


def test_compiled_steps_are_one_graph_each_for_every_step_and_batch_shape_and_train_as_eager(
        tiny, capture_dir, tmp_path, monkeypatch):
    """The TTT step's functions trace whole (fullgraph: a graph break would raise) with symbolic
    sizes and the step's slot as a tensor, so every later step and every batch of other rows and
    length reuse one graph per function; losses and gradients are eager's. aot_eager runs the same
    trace and autograd split as inductor without generating kernels (minutes on a CPU)."""
    import functools

    from torch._dynamo.utils import counters

    from specdec.train import loop
    from specdec.train.drafter_init import make_drafter
    from specdec.train.ttt import TargetArgmaxCache, TargetHead

    target = load_target(tiny, device="cpu")
    source = OfflineSource(CaptureStore(capture_dir))
    cfg = TrainConfig(out=str(tmp_path / "x"), draft_vocab_size=64, ttt_steps=4)
    drafter, _ = make_drafter(target, source, cfg, None)
    head = TargetHead.from_target(target)
    eager = loop.DrafterTTT(drafter, head, 4, 0.8)
    torch._dynamo.reset()
    counters.clear()
    fast = loop.DrafterTTT(drafter, head, 4, 0.8, fns=loop.compiled_steps(backend="aot_eager"))
    samples = TargetArgmaxCache(source, head, "cpu")  # as train() draws them: the target's argmax known
    graphs = []
    for rows in ([0, 1], [2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16], [17, 18]):  # other rows, lengths
        inputs = loop._to(samples.get(rows), "cpu", torch.float32)
        grads = []
        for module in (eager, fast):
            drafter.zero_grad()
            loss, correct, _, counted = module(*inputs)
            loss.backward()
            grads.append((loss.detach(), correct, [p.grad.clone() for p in drafter.parameters() if p.requires_grad]))
        (l0, c0, g0), (l1, c1, g1) = grads
        torch.testing.assert_close(l1, l0)
        assert torch.equal(c1, c0)
        for a, b in zip(g1, g0):
            torch.testing.assert_close(a, b)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [3] * len(graphs), graphs  # first step, later steps, loss: compiled once, for all

    # Wired into train(): compile=True trains to eager's weights.
    monkeypatch.setattr(loop, "compiled_steps", functools.partial(loop.compiled_steps, backend="aot_eager"))
    runs = {}  # in fp32: under bf16 autocast the two round apart
    for name, compile_ in (("eager", False), ("compiled", True)):
        c = TrainConfig(out=str(tmp_path / name), max_steps=6, draft_vocab_size=64, batch_tokens=1024,
                        ttt_steps=3, lr=3e-3, eval_every=10_000, bf16=False, compile=compile_)
        runs[name] = train(target, source, c, progress=False)
    assert runs["compiled"]["compiled"] and not runs["eager"]["compiled"]
    assert runs["compiled"]["last_loss"] == pytest.approx(runs["eager"]["last_loss"], rel=1e-4)
    a, b = _weights(tmp_path / "eager"), _weights(tmp_path / "compiled")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5, msg=k)


def _weights(path):
    return load_file(str(Path(path) / "drafter" / "model.safetensors"))


def test_online_training_trains_as_offline_and_resumes_exactly(tiny, capture_dir, tmp_path):
    """`train --online` (the target's forward inside the loop, nothing on disk) sees the tensors the
    capture stores, up to the last bits (batched with other conversations, the target's states
    differ by ~1e-8), so on the same conversations it trains to the offline run's loss and
    held-out figures; and it resumes from a checkpoint to the straight run's weights exactly."""
    import shutil

    regen = capture_dir.parent / "regen.jsonl"  # what the capture was made from
    args = ("--max-steps", "8", "--save-every", "4", "--eval-every", "4", "--json", "--dtype", "fp32")
    runs = {}
    for name, data, extra in (("offline", capture_dir, ()), ("online", regen, ("--online",))):
        r = subprocess.run(train_cmd(tiny, data, tmp_path / name, *extra, *args), env=ENV, capture_output=True,
                           text=True)
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads(r.stdout.strip().splitlines()[-1])
        # The minutes before the first step are accounted for: the target's load, the data, the set-up.
        s = runs[name]
        assert (f"set up in {s['setup_s']:.0f} s, load target {s['load_target_s']:.0f} s, "
                f"read data {s['read_data_s']:.0f} s") in r.stderr, r.stderr
    assert runs["online"]["steps"] == runs["offline"]["steps"] == 8
    assert runs["online"]["last_loss"] == pytest.approx(runs["offline"]["last_loss"], rel=1e-5)
    # Those last bits may flip one held-out position at a near-tie, no more (AdamW turns them into
    # weights that differ by up to ~lr, so the weights are not compared).
    held = runs["offline"]["eval"]["eval_positions"]
    assert runs["online"]["eval"]["eval_positions"] == held > 0
    assert runs["online"]["eval"]["per_position_accuracy"] == pytest.approx(
        runs["offline"]["eval"]["per_position_accuracy"], abs=1.01 / held)
    # Resumed from its step-4 checkpoint, the online run ends where it ended straight through.
    shutil.copytree(tmp_path / "online" / "checkpoints" / "step-4", tmp_path / "resumed" / "checkpoints" / "step-4")
    r = subprocess.run(train_cmd(tiny, regen, tmp_path / "resumed", "--online", *args, "--resume"), env=ENV,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "resuming from" in r.stderr, r.stderr
    b, c = _weights(tmp_path / "online"), _weights(tmp_path / "resumed")
    for k in b:
        torch.testing.assert_close(c[k], b[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("kill_after", [4, 12])
def test_kill_9_then_resume_is_exact(tiny, capture_dir, tmp_path, kill_after):
    args = ("--max-steps", "24", "--save-every", "4")
    straight = tmp_path / "straight"
    subprocess.run(train_cmd(tiny, capture_dir, straight, *args), check=True, env=ENV, capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(tiny, capture_dir, killed, *args), env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / f"step-{kill_after}" / "state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "training ended before its first checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "train_summary.json").exists()  # really interrupted
    # The same command without --resume neither starts over nor deletes the checkpoints: it says what to do.
    kept = sorted(p.name for p in (killed / "checkpoints").iterdir())
    r = subprocess.run(train_cmd(tiny, capture_dir, killed, *args), env=ENV, capture_output=True, text=True)
    assert r.returncode == 2 and "--resume" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == kept
    r = subprocess.run(train_cmd(tiny, capture_dir, killed, *args, "--resume"), env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "resuming from" in r.stderr
    a, b = _weights(straight), _weights(killed)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    assert json.loads((killed / "train_summary.json").read_text())["steps"] == 24
    # Checkpoints leave out the frozen embedding (the target's); the resume above restored it.
    from safetensors import safe_open

    with safe_open(str(killed / "checkpoints" / "step-24" / "drafter.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys() and "fc.weight" in f.keys()


def test_dtype_flag_sets_the_matmul_precision(tiny, capture_dir, tmp_path):
    for flag, want in (("auto", dtype_name(compute_dtype("cpu"))), ("fp32", "float32"),
                       ("bf16", "bfloat16")):
        out = tmp_path / flag
        r = subprocess.run(train_cmd(tiny, capture_dir, out, "--max-steps", "2", "--dtype", flag),
                           env=ENV, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert json.loads((out / "train_summary.json").read_text())["matmul_dtype"] == want


def test_intermediate_size_sets_the_drafter_mlp_width(tiny, capture_dir, tmp_path):
    out = tmp_path / "narrow"
    r = subprocess.run(train_cmd(tiny, capture_dir, out, "--max-steps", "2", "--intermediate-size", "24"),
                       env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    target = load_target(tiny, device="cpu")
    assert json.loads((out / "drafter" / "config.json").read_text())["intermediate_size"] == 24
    drafter = load_drafter(out / "drafter", target)
    assert drafter.midlayer.mlp.gate_proj.weight.shape[0] == 24
    assert target.config.intermediate_size != 24  # not the target's width by accident


def test_vocab_mapping_survives_init(tiny, capture_dir, tmp_path):
    target = load_target(tiny, device="cpu")
    base = TrainConfig(out=str(tmp_path / "a"), max_steps=3, draft_vocab_size=64, batch_tokens=1024, ttt_steps=2,
                       eval_every=10_000)
    train(target, OfflineSource(CaptureStore(capture_dir)), base, progress=False)
    first = load_drafter(tmp_path / "a" / "drafter", target)
    other = tmp_path / "cap2"
    run_capture(target, records(16, seed=5, words=("zeta", "omega", "kappa")), other, dtype=torch.float32,
                progress=False, check_space=False)
    tuned = TrainConfig(out=str(tmp_path / "b"), max_steps=3, draft_vocab_size=64, batch_tokens=1024, ttt_steps=2,
                        eval_every=10_000)
    train(target, OfflineSource(CaptureStore(other)), tuned, init=str(tmp_path / "a" / "drafter"), progress=False)
    second = load_drafter(tmp_path / "b" / "drafter", target)
    assert torch.equal(first.d2t, second.d2t)
    assert not torch.equal(first.lm_head.weight, second.lm_head.weight)  # it did train
    rebuilt = TrainConfig(out=str(tmp_path / "c"), max_steps=1, draft_vocab_size=64, batch_tokens=1024,
                          ttt_steps=2, eval_every=10_000, rebuild_vocab=True)
    train(target, OfflineSource(CaptureStore(other)), rebuilt, init=str(tmp_path / "a" / "drafter"), progress=False)
    assert not torch.equal(first.d2t, load_drafter(tmp_path / "c" / "drafter", target).d2t)


def test_ddp_gloo_two_processes_and_resume_on_one(tiny, capture_dir, tmp_path):
    out = tmp_path / "ddp"
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(port)]
    cmd = torchrun + train_cmd(tiny, capture_dir, out, "--max-steps", "4", "--save-every", "2")[1:]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world size 2" in r.stderr
    assert (out / "checkpoints" / "step-4" / "state.json").exists()
    # Change of world size: continue the same run on one process for more steps.
    r = subprocess.run(train_cmd(tiny, capture_dir, out, "--max-steps", "6", "--save-every", "2", "--resume"),
                       env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stderr and json.loads((out / "train_summary.json").read_text())["steps"] == 6


def test_doctor_runs_on_a_real_engine(tiny, capture_dir, tmp_path):
    from specdec.data.datasets import Conversation
    from specdec.doctor import diagnose_drafter

    target = load_target(tiny, device="cpu")
    train(target, OfflineSource(CaptureStore(capture_dir)),
          TrainConfig(out=str(tmp_path / "run"), max_steps=2, draft_vocab_size=64, batch_tokens=1024, ttt_steps=2,
                      eval_every=10_000), progress=False)
    drafter = load_drafter(tmp_path / "run" / "drafter", target)
    prompts = [Conversation(id=r["id"], messages=r["messages"][:1]) for r in records(2)]
    result = diagnose_drafter(target, drafter, prompts, k=3, max_new_tokens=8)
    names = [r["hypothesis"] for r in result["rows"]]
    assert names[0] == "as configured" and "aux ids -1" in names and "identity d2t" in names
    assert all(r["mean_acceptance_length"] >= 1.0 for r in result["rows"])


def test_steps_walk_epochs_of_different_sizes():
    """Epochs pack into different numbers of batches; every step must land inside one, in order
    (locating steps by epoch 0's size once left training spinning forever at an epoch's end)."""
    import random

    from specdec.train.data import batches_at, global_batches

    rng = random.Random(0)
    lengths = [rng.randint(20, 250) for _ in range(300)]
    idx = list(range(300))
    sizes = [len(global_batches(idx, lengths, 256, seed=0, epoch=e)) for e in range(4)]
    assert len(set(sizes)) > 1  # the case that matters is present
    walked = [batches_at(s, idx, lengths, 256, seed=0) for s in range(sum(sizes))]
    expected = [(e, p) for e in range(4) for p in range(sizes[e])]
    assert [(e, p) for e, p, _ in walked] == expected
    assert all(p < len(b) for _, p, b in walked)
    assert sorted(i for e, p, b in walked if e == 1 for i in b[p]) == idx  # an epoch sees every sample once
    # step_batches, what the loop walks, starts anywhere and agrees with locating each step alone.
    from specdec.train.data import step_batches

    every = list(step_batches(0, sum(sizes), idx, lengths, 256, seed=0))
    assert every == [b[p] for _, p, b in walked]
    for start in (0, 1, sizes[0] - 1, sizes[0], sizes[0] + sizes[1] + 3):
        assert list(step_batches(start, sum(sizes), idx, lengths, 256, seed=0)) == every[start:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: batches load on a second stream there")
def test_cuda_prefetch_yields_each_batch_in_order_after_its_copy():
    from specdec.train.prefetch import Prefetch

    dev = torch.device("cuda")
    host = [torch.randn(64, 1024).pin_memory() for _ in range(12)]

    def load(i):
        slow = torch.randn(1024, 1024, device=dev)
        for _ in range(20):  # work queued on the worker's stream before the copy
            slow = slow @ slow.T / 1024
        return i, (host[i].to(dev, non_blocking=True) + 0 * slow[:64].sum(),)

    seen = []
    for i, (t,) in Prefetch(load, range(12), dev):
        seen.append(i)
        torch.testing.assert_close(t.cpu(), host[i])
    assert seen == list(range(12))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the prefetching loop runs there")
@pytest.mark.parametrize("graphs", [False, True], ids=["steps", "cuda_graphs"])
def test_cuda_training_resumes_from_a_checkpoint_to_the_same_weights(tiny, capture_dir, tmp_path, graphs):
    """Also with each step a recorded CUDA graph: the resumed run records its own graphs, reads its
    learning rate from a device tensor again, and replays to the straight run's weights."""
    import shutil

    target = load_target(tiny, device="cuda")
    source = OfflineSource(CaptureStore(capture_dir))

    def cfg(out):
        return TrainConfig(out=str(out), epochs=100, max_steps=12, save_every=4, keep_checkpoints=10,
                           draft_vocab_size=64, batch_tokens=1024, ttt_steps=3, lr=3e-3, eval_every=6,
                           cuda_graphs=graphs)

    assert train(target, source, cfg(tmp_path / "straight"), progress=False)["steps"] == 12
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step-4", tmp_path / "resumed" / "checkpoints" / "step-4")
    summary = train(target, source, cfg(tmp_path / "resumed"), resume=True, progress=False)
    assert summary["resumed_from"].endswith("step-4") and summary["steps"] == 12
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the online forward on its own stream")
@pytest.mark.parametrize("graphs", [False, True], ids=["steps", "cuda_graphs"])
def test_cuda_online_training_trains_as_offline(tiny, capture_dir, tmp_path, graphs):
    """On a GPU, with the target's forward in the loop (on the prefetch stream, without cuDNN's
    attention) and its states on the GPU: trained online on the capture's conversations, the
    drafter reaches the offline run's loss and held-out accuracy, stepped or recorded."""
    from specdec.capture.run import load_records
    from specdec.data.chat import render
    from specdec.train.data import OnlineSource

    target = load_target(tiny, device="cuda")
    store = CaptureStore(capture_dir)
    convs = {str(r["id"]): r["messages"] for r in load_records(str(capture_dir.parent / "regen.jsonl"))}
    ids = list(store.sample_ids)
    online = OnlineSource(target, [render(target.tokenizer, convs[i]) for i in ids], ids, torch.float32, None)
    runs = {}
    for name, source in (("offline", OfflineSource(store)), ("online", online)):
        c = TrainConfig(out=str(tmp_path / name), max_steps=10, draft_vocab_size=64, batch_tokens=1024, ttt_steps=3,
                        lr=3e-3, eval_every=5, bf16=False, cuda_graphs=graphs)
        runs[name] = train(target, source, c, progress=False)
    assert runs["online"]["steps"] == runs["offline"]["steps"] == 10
    # Recorded steps record the target's forward too, one graph per padded shape.
    assert online.recorded.failed is None and bool(online.recorded.shapes) == graphs
    assert runs["online"]["last_loss"] == pytest.approx(runs["offline"]["last_loss"], rel=1e-3)
    # The GPU's forward and the CPU capture's differ in the last bits, and the tiny target's logits
    # hold near-ties: a position or two of the ~40 held out may flip (1 / 42 = 0.024).
    assert runs["online"]["eval"]["per_position_accuracy"] == pytest.approx(
        runs["offline"]["eval"]["per_position_accuracy"], abs=0.06)


def test_length_buckets_pad_every_batch_to_one_shape_per_bucket_within_the_token_budget():
    """With a length multiple, a batch's padded shape depends on its length bucket alone (what
    lets CUDA graphs replay a few shapes), it never holds more than batch_tokens padded tokens
    unless one sample alone is longer, and an epoch still sees every sample once."""
    import random

    from specdec.train.data import global_batches, padded_shape

    rng = random.Random(1)
    lengths = [rng.randint(5, 700) for _ in range(500)] + [1500]  # one sample longer than the budget
    idx = list(range(len(lengths)))
    shapes: dict[int, set] = {}
    for epoch in range(3):
        batches = global_batches(idx, lengths, 1024, seed=0, epoch=epoch, multiple=64)
        assert sorted(i for b in batches for i in b) == idx
        for b in batches:
            rows, length = padded_shape(len(b), max(lengths[i] for i in b), 1024, 64)
            assert length % 64 == 0 and length >= max(lengths[i] for i in b) > length - 64
            assert rows >= len(b) and (rows * length <= 1024 or rows == 1)
            shapes.setdefault(length, set()).add(rows)
    assert all(len(rows) == 1 for rows in shapes.values()), shapes
    assert len(shapes) == len({-(-n // 64) for n in lengths})  # every bucket met, one shape each
    # Without a multiple, the batch's own shape, as before.
    assert padded_shape(3, 77, 1024, 1) == (3, 77)


def test_padding_to_a_bucket_changes_neither_loss_nor_gradients(tiny, capture_dir):
    """Rows and columns of padding (valid = False) add nothing to the loss, the accuracies or the
    gradients: a batch padded to its bucket's shape trains as the batch itself."""
    from specdec.train import loop
    from specdec.train.drafter_init import make_drafter
    from specdec.train.ttt import TargetArgmaxCache, TargetHead

    target = load_target(tiny, device="cpu")
    source = OfflineSource(CaptureStore(capture_dir))
    drafter, _ = make_drafter(target, source, TrainConfig(out="unused", draft_vocab_size=64, ttt_steps=4), None)
    module = loop.DrafterTTT(drafter, TargetHead.from_target(target), 4, 0.8)
    samples = TargetArgmaxCache(source, module.head, "cpu").get([3, 4, 5])
    L = max(len(s["input_ids"]) for s in samples)
    results = []
    for shape in (None, (7, L + 45)):
        inputs = loop._to(samples, "cpu", torch.float32, shape)
        assert inputs[0].shape == ((3, L) if shape is None else shape)
        drafter.zero_grad()
        loss, correct, step_correct, counted = module(*inputs)
        loss.backward()
        results.append((loss.detach(), correct, step_correct, counted,
                        [p.grad.clone() for p in drafter.parameters() if p.requires_grad]))
    (l0, c0, s0, n0, g0), (l1, c1, s1, n1, g1) = results
    torch.testing.assert_close(l1, l0)
    assert torch.equal(c1, c0) and torch.equal(s1, s0) and float(n1) == float(n0) > 0
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA graphs")
def test_cuda_graph_training_trains_as_eager(tiny, capture_dir, tmp_path):
    """`cuda_graphs`: each optimizer step recorded once per bucket shape and replayed (the graphs
    sharing one memory pool, the learning rate read from a device tensor), with the loss eager or
    compiled inside, trains to eager's loss, held-out accuracy and weights on the same padded
    batches, across evaluations between the replays."""
    target = load_target(tiny, device="cuda")
    source = OfflineSource(CaptureStore(capture_dir))
    runs = {}
    for name, graphs, compiled in (("eager", False, False), ("graphs", True, False), ("compiled", True, True)):
        c = TrainConfig(out=str(tmp_path / name), max_steps=10, draft_vocab_size=64, batch_tokens=1024,
                        ttt_steps=3, lr=3e-3, eval_every=5, bf16=False, cuda_graphs=graphs, compile=compiled,
                        length_multiple=64)
        runs[name] = train(target, source, c, progress=False)
    assert not runs["eager"]["cuda_graphs"] and runs["eager"]["cuda_graph_shapes"] == 0
    for name in ("graphs", "compiled"):
        run = runs[name]
        # Step 1 runs as it is; every later step replays a graph, so some shape was recorded.
        assert run["cuda_graphs"] and run["compiled"] == (name == "compiled") and run["cuda_graph_shapes"] >= 1
        assert run["last_loss"] == pytest.approx(runs["eager"]["last_loss"], rel=1e-3), name
        assert run["eval"]["per_position_accuracy"] == pytest.approx(
            runs["eager"]["eval"]["per_position_accuracy"], abs=0.02), name
        a, b = _weights(tmp_path / "eager"), _weights(tmp_path / name)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-4, msg=f"{name}: {k}")


def test_a_learning_rate_held_in_a_tensor_follows_the_schedule_in_place_and_round_trips():
    """What a step recorded as a CUDA graph relies on (train/step_graphs.py, hold_lr): once the
    scheduler has read its base rate, the group's rate becomes one tensor that every scheduler step
    fills in place (a graph reads it by address), the updates equal those of a float rate, and a
    checkpoint of either kind loads back into either kind."""
    from specdec.train.loop import lr_factor
    from specdec.train.step_graphs import hold_lr

    def setup(tensor: bool):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 3))
        opt = torch.optim.AdamW([w], lr=1e-2, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, 10, 3, 0.1))
        hold_lr(opt, torch.device("cpu") if tensor else None)
        return w, opt, sched

    w_f, opt_f, sched_f = setup(False)
    w_t, opt_t, sched_t = setup(True)
    held = opt_t.param_groups[0]["lr"]
    assert isinstance(held, torch.Tensor) and isinstance(opt_f.param_groups[0]["lr"], float)
    for step in range(8):
        for w, opt, sched in ((w_f, opt_f, sched_f), (w_t, opt_t, sched_t)):
            w.grad = torch.full_like(w, 0.5 + step)
            opt.step()
            sched.step()
        assert opt_t.param_groups[0]["lr"] is held  # filled in place, never replaced
        assert float(held) == pytest.approx(1e-2 * lr_factor(step + 1, 10, 3, 0.1), rel=1e-6)
        torch.testing.assert_close(w_t, w_f, rtol=1e-6, atol=1e-7)
    for source, into in ((opt_t, False), (opt_f, True)):
        _, opt, _ = setup(into)
        opt.load_state_dict(source.state_dict())
        hold_lr(opt, torch.device("cpu") if into else None)
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) == into
        assert float(opt.param_groups[0]["lr"]) == pytest.approx(float(held), rel=1e-6)
