"""`specdec capture`: what is stored equals what the target computes, the manifest says what made
it, reruns resume (also after kill -9) and never mix captures, ranks split the data."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from specdec.capture import store as st
from specdec.capture.run import capture_batch, plan_shards, prepare, run_capture
from specdec.capture.store import CaptureStore
from specdec.data.chat import render
from specdec.errors import SpecdecError


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_targets):
    return tiny_targets["llama"]


def records(n=6, offset=0):
    """Regenerate-style records of varied lengths (one with no assistant turn)."""
    out = []
    for i in range(offset, offset + n):
        msgs = [{"role": "user", "content": f"question {i} " * (1 + i % 4)},
                {"role": "assistant", "content": f"answer {i} " * (2 + i % 5)}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "done."}]
        out.append({"id": f"s{i}", "messages": msgs, "target": "tiny-llama", "finish_reason": "stop", "new_tokens": 3})
    return out


def capture(target, out, recs, **kw):
    kw = {"shard_tokens": 150, "max_length": 256, "batch_size": 2, "progress": False, "log": lambda s: None, **kw}
    return run_capture(target, recs, out, **kw)


def test_round_trip_equals_target_forward(target, tmp_path):
    recs = records(5)
    s = capture(target, tmp_path / "cap", recs)
    store = CaptureStore(tmp_path / "cap")
    assert len(store) == 5 == s.samples and s.shards > 1
    assert store.lengths() == [len(render(target.tokenizer, recs[int(i[1:])]["messages"])) for i in store.sample_ids]
    H = target.hidden_size
    for r in recs:
        x = store.sample(store.sample_ids.index(r["id"]))
        rd = render(target.tokenizer, r["messages"])
        ref = target.forward(torch.tensor([rd.input_ids]), capture=True)
        assert x["input_ids"].dtype == torch.int32 and x["input_ids"].tolist() == rd.input_ids
        assert x["loss_mask"].dtype == torch.uint8 and x["loss_mask"].tolist() == rd.loss_mask
        assert x["aux_hidden"].dtype == torch.bfloat16 and x["aux_hidden"].shape == (len(rd), 3 * H)
        assert x["last_hidden"].shape == (len(rd), H)
        torch.testing.assert_close(x["aux_hidden"].float(), ref.aux_hidden[0], atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(x["last_hidden"].float(), ref.last_hidden[0], atol=2e-2, rtol=1e-2)
        # The stored pre-norm state gives the target distribution through norm + lm_head.
        logits = target.lm_head()(target.final_norm()(x["last_hidden"].float()))
        assert (logits.argmax(-1) == ref.logits[0].argmax(-1)).float().mean() > 0.9


def test_online_capture_batch_is_what_offline_stores(target, tmp_path):
    """The trainer's online path and the offline shards see identical tensors."""
    recs = records(3)
    capture(target, tmp_path / "cap", recs, batch_size=1)
    store = CaptureStore(tmp_path / "cap")
    for r in recs:
        (online,) = capture_batch(target, [render(target.tokenizer, r["messages"])], torch.bfloat16)
        offline = store.sample(store.sample_ids.index(r["id"]))
        for k in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            assert online[k].dtype == offline[k].dtype and torch.equal(online[k], offline[k]), k


def test_the_capture_forward_runs_without_cudnn_attention(target):
    """cuDNN's attention plans every new shape on the host, and each padded batch is a new shape:
    the capture's forward (online training's too) runs with that backend off, and leaves the
    process's setting as it found it."""
    seen = []
    handle = target.model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        before = torch.backends.cuda.cudnn_sdp_enabled()
        capture_batch(target, [render(target.tokenizer, r["messages"]) for r in records(2)], torch.float32)
    finally:
        handle.remove()
    assert seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_padding_in_a_batch_changes_nothing(target):
    rs = [render(target.tokenizer, r["messages"]) for r in records(3)]
    batched = capture_batch(target, rs, torch.float32)
    for r, b in zip(rs, batched):
        (alone,) = capture_batch(target, [r], torch.float32)
        torch.testing.assert_close(b["aux_hidden"], alone["aux_hidden"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b["last_hidden"], alone["last_hidden"], atol=1e-5, rtol=1e-5)


def test_padding_to_a_larger_shape_changes_nothing(target):
    """Online training with CUDA graphs runs the target's forward at the batch's padded shape (one
    recorded graph per shape): the forward does run at that shape, and the real rows' states are
    those of the batch's own shape."""
    rs = [render(target.tokenizer, r["messages"]) for r in records(3)]
    longest = max(len(r.input_ids) for r in rs)
    seen = []
    handle = target.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        own = capture_batch(target, rs, torch.float32)
        padded = capture_batch(target, rs, torch.float32, shape=(5, longest + 37))
    finally:
        handle.remove()
    assert seen == [(3, longest), (5, longest + 37)]
    for a, b in zip(own, padded):
        assert torch.equal(a["input_ids"], b["input_ids"]) and a["aux_hidden"].shape == b["aux_hidden"].shape
        torch.testing.assert_close(b["aux_hidden"], a["aux_hidden"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b["last_hidden"], a["last_hidden"], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA graphs")
def test_cuda_the_recorded_forward_gives_the_eager_states(tiny_dirs):
    """The target's forward replayed from a CUDA graph per padded shape (online training with
    --cuda-graphs): the eager forward's states at that shape, for two shapes, for a second batch
    of a recorded shape (its ids copied in before the replay), and from a second thread (its own
    graphs). Against the eager forward at the same padded shape: the target runs in bf16 on CUDA,
    where another shape picks other kernels and moves the last bit (that padding changes nothing
    else is test_padding_to_a_larger_shape_changes_nothing's, in fp32). A replay of another batch's
    ids or another thread's graphs gives other states, far outside a bf16 ulp."""
    import threading

    from specdec.capture.run import RecordedForward
    from specdec.models.target import load_target

    gpu = load_target(str(tiny_dirs["llama"]), device="cuda")
    assert gpu.dtype == torch.bfloat16
    BF16 = dict(atol=1e-3, rtol=1.6e-2)  # torch's rtol for bf16; atol about two ulps at the states' scale
    rs = [render(gpu.tokenizer, r["messages"]) for r in records(6)]
    recorded = RecordedForward(gpu)
    # Shapes larger than every sample (61-145 tokens), so each batch pads to its shape exactly.
    assert max(len(r) for r in rs) <= 160
    batches = [(rs[:3], (4, 160)), (rs[3:], (4, 160)), (rs[:2], (3, 96)), (rs[3:], (4, 160))]

    def check(results):
        for batch, shape in batches:
            got = capture_batch(gpu, batch, torch.float32, shape=shape, recorded=recorded)
            want = capture_batch(gpu, batch, torch.float32, shape=shape)
            for g, w in zip(got, want):
                torch.testing.assert_close(g["aux_hidden"], w["aux_hidden"], **BF16)
                torch.testing.assert_close(g["last_hidden"], w["last_hidden"], **BF16)
        results.append(True)

    done = []
    check(done)
    worker = threading.Thread(target=check, args=(done,))
    worker.start()
    worker.join()
    assert done == [True, True]
    assert recorded.failed is None and recorded.shapes == {(4, 160), (3, 96)}


def test_two_threads_capture_at_once_each_their_own_states(target):
    """Online training's held-out evaluation captures on the main thread while the prefetch thread
    captures the next batches: each forward gets its own hidden states (the hooks' store was one
    per target, and a forward in one thread emptied the other's mid-flight)."""
    import threading

    rs = [render(target.tokenizer, r["messages"]) for r in records(4)]
    want = [capture_batch(target, [r], torch.float32)[0] for r in rs]
    errors = []

    def work(r, ref):
        try:
            for _ in range(60):
                (got,) = capture_batch(target, [r], torch.float32)
                assert torch.equal(got["aux_hidden"], ref["aux_hidden"])
                assert torch.equal(got["last_hidden"], ref["last_hidden"])
        except Exception as e:  # noqa: BLE001 - reported on the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r, ref)) for r, ref in zip(rs, want)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_manifest_says_what_made_the_capture(target, tmp_path):
    recs = records(6)
    s = capture(target, tmp_path / "cap", recs)
    m = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert m["format"] == "specdec-capture" and m["version"] == 1
    assert m["target"] == target.name and m["target_fingerprint"] == target.fingerprint()
    assert m["aux_layer_ids"] == target.aux_layer_ids and m["layer_convention"] == "eagle"
    assert m["dtype"] == "bfloat16" and m["hidden_size"] == target.hidden_size and m["max_length"] == 256
    assert m["tokenizer_fingerprint"] == st.tokenizer_fingerprint(target.tokenizer, target.eos_token_ids)
    assert m["eos_token_ids"] == list(target.eos_token_ids)
    assert m["num_samples"] == 6 and m["num_tokens"] == s.tokens
    assert m["num_loss_tokens"] == sum(sum(render(target.tokenizer, r["messages"]).loss_mask) for r in recs)
    ids = [i for sh in m["shards"] for i in sh["sample_ids"]]
    assert sorted(ids) == sorted(r["id"] for r in recs)
    files = sorted(p.name for p in (tmp_path / "cap").glob("shard-*.safetensors"))
    assert files == sorted(sh["file"] for sh in m["shards"]) and files[0] == "shard-00000.safetensors"
    assert m["bytes"] == sum((tmp_path / "cap" / f).stat().st_size for f in files)
    # Byte cost: ids 4 + mask 1 + 4 states of H bf16 values; the data section is exactly that.
    assert st.bytes_per_token(64, "bf16") == 5 + 4 * 64 * 2
    assert m["bytes"] - s.tokens * st.bytes_per_token(64, "bf16") < 1024 * len(files)
    # Shards describe themselves too.
    from safetensors import safe_open

    with safe_open(str(tmp_path / "cap" / files[0]), "pt") as f:
        assert json.loads(f.metadata()["sample_ids"]) == m["shards"][0]["sample_ids"]


def test_resume_skips_captured_ids_and_redoes_orphans(target, tmp_path):
    out = tmp_path / "cap"
    capture(target, out, records(4))
    before = json.loads((out / "manifest.json").read_text())
    (out / "shard-00042.safetensors").write_bytes(b"half a shard")  # renamed, never listed: a kill
    (out / ".shard-00043.safetensors.abc.tmp").write_bytes(b"torn")
    s = capture(target, out, records(7))
    assert s.skipped_done == 4 and s.samples == 3
    assert set(s.removed_orphans) == {"shard-00042.safetensors", ".shard-00043.safetensors.abc.tmp"}
    m = json.loads((out / "manifest.json").read_text())
    ids = [i for sh in m["shards"] for i in sh["sample_ids"]]
    assert sorted(ids) == sorted(f"s{i}" for i in range(7)) and len(ids) == len(set(ids))
    assert m["shards"][: len(before["shards"])] == before["shards"]
    assert capture(target, out, records(7)).samples == 0
    assert len(CaptureStore(out)) == 7


def test_refuses_to_mix_captures(target, tiny_dirs, tmp_path):
    out = tmp_path / "cap"
    capture(target, out, records(2))
    from specdec.models.target import load_target
    from specdec.models.tiny import make_tiny_target

    other = load_target(str(make_tiny_target("llama", tmp_path / "other", seed=1)), device="cpu")
    with pytest.raises(SpecdecError, match="target_fingerprint .*refusing to mix"):
        capture(other, out, records(3))
    with pytest.raises(SpecdecError, match="dtype 'bfloat16' \\(on disk\\) vs 'float16'"):
        capture(target, out, records(3), dtype="fp16")
    old = list(target.aux_layer_ids)
    try:
        target.set_aux_layer_ids([1, 2, 3])
        with pytest.raises(SpecdecError, match="aux_layer_ids"):
            capture(target, out, records(3))
    finally:
        target.set_aux_layer_ids(old)
    assert len(CaptureStore(out)) == 2  # untouched


def test_cli_refusal_is_one_line(tiny_dirs, tmp_path, capsys):
    from specdec.cli import main

    data = tmp_path / "regen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(2)))
    args = ["capture", "--target", str(tiny_dirs["llama"]), "--data", str(data), "-o", str(tmp_path / "cap"),
            "--no-progress", "--max-length", "128"]
    assert main(args) == 0
    assert main(args[:-1] + ["64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("specdec capture: error:") and "max_length 128 (on disk) vs 64 (this run)" in err


def test_cli_refuses_aux_ids_out_of_layer_order(tiny_dirs, tmp_path, capsys):
    # vLLM and SGLang feed the captured layers in layer order: an fc trained on [3, 1, 2] would be
    # served [1, 2, 3]'s columns.
    from specdec.cli import main

    data = tmp_path / "regen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(1)))
    assert main(["capture", "--target", str(tiny_dirs["llama"]), "--data", str(data), "-o", str(tmp_path / "cap"),
                 "--no-progress", "--aux-layer-ids", "3,1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "ascending, distinct" in err and "pass 1,2,3" in err
    assert not (tmp_path / "cap").exists()


def test_refuses_when_the_projection_exceeds_free_space(target, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(SpecdecError, match=r"capture needs about .* but .* has 1.0 KB free"):
        capture(target, tmp_path / "cap", records(3))
    assert not list((tmp_path / "cap").glob("shard-*"))


def test_ranks_split_the_data_and_the_reader_splits_again(target, tmp_path):
    out, recs = tmp_path / "cap", records(7)
    got = []
    for rank in (0, 1):
        s = capture(target, out, recs, rank=rank, world_size=2)
        got.append(s.samples)
    assert got == [4, 3]
    m = json.loads((out / "manifest.json").read_text())
    by_rank = {0: set(), 1: set()}
    for sh in m["shards"]:
        rank = int(sh["file"].split("-")[1][1:])
        assert sh["file"].startswith(f"shard-r{rank}-")
        by_rank[rank] |= set(sh["sample_ids"])
    assert by_rank[0] == {f"s{i}" for i in range(0, 7, 2)} and by_rank[1] == {f"s{i}" for i in range(1, 7, 2)}
    store = CaptureStore(out)
    parts = [store.indices(shuffle=True, seed=3, rank=r, world_size=2) for r in (0, 1)]
    assert len(parts[0]) == len(parts[1]) == 3 and not set(parts[0]) & set(parts[1])
    assert parts == [store.indices(shuffle=True, seed=3, rank=r, world_size=2) for r in (0, 1)]
    assert store.indices(shuffle=True, seed=4) != store.indices(shuffle=True, seed=3)
    assert sorted(store.indices(shuffle=True, seed=3)) == list(range(7))
    n = sum(1 for _ in store.iter_samples(shuffle=True, seed=0, rank=1, world_size=2))
    assert n == 3


def test_plan_shards_longest_first_and_sized():
    from specdec.capture.run import Item
    import numpy as np

    items = [Item(f"x{i}", np.zeros(n, np.int32), np.ones(n, np.uint8)) for i, n in enumerate([5, 30, 10, 20, 1])]
    shards = plan_shards(items, 25)
    assert [[len(i) for i in s] for s in shards] == [[30], [20, 10], [5, 1]]


def test_prepare_truncates_and_skips_samples_without_loss(target):
    recs = records(3) + [{"id": "q", "messages": [{"role": "user", "content": "no answer"}]}]
    p = prepare(recs, target.tokenizer, max_length=20, done={"s1"}, progress=False)
    assert p.already_done == 1
    assert [it.id for it in p.items] == [] and p.skipped_no_loss == 3  # 20 tokens hold no assistant text
    p = prepare(recs, target.tokenizer, max_length=None, done=set(), progress=False)
    assert [it.id for it in p.items] == ["s0", "s1", "s2"] and p.skipped_no_loss == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill9_after_some_shards_then_resume(tiny_dirs, tmp_path, seed):
    """Killed after a random number of shards (one seed each), the rerun completes the same capture."""
    import random

    want = random.Random(seed).randint(1, 30)
    data = tmp_path / "regen.jsonl"
    n = 80
    data.write_text("".join(json.dumps(r) + "\n" for r in records(n)))
    out = tmp_path / "cap"
    args = ["capture", "--target", str(tiny_dirs["llama"]), "--data", str(data), "-o", str(out),
            "--shard-tokens", "1", "--batch-size", "1", "--max-length", "256", "--no-progress"]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "specdec", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env)
    manifest = out / "manifest.json"
    deadline = time.monotonic() + 90
    while not (manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= want):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    killed = json.loads(manifest.read_text())
    assert proc.returncode == -signal.SIGKILL and 1 <= killed["num_samples"] < n

    from specdec.cli import main

    assert main(args) == 0
    m = json.loads(manifest.read_text())
    ids = [i for sh in m["shards"] for i in sh["sample_ids"]]
    assert len(ids) == len(set(ids)) == n and m["num_samples"] == n
    assert m["shards"][: len(killed["shards"])] == killed["shards"]
    listed = {sh["file"] for sh in m["shards"]}
    assert {p.name for p in out.iterdir() if p.name.startswith(("shard-", ".shard-"))} == listed
    store = CaptureStore(out)
    assert len(store) == n and all(len(store.sample(i)["input_ids"]) > 0 for i in range(0, n, 9))
    # What an uninterrupted capture holds, sample for sample.
    straight = tmp_path / "straight"
    assert main(args[:args.index("-o") + 1] + [str(straight)] + args[args.index("-o") + 2:]) == 0
    ref = CaptureStore(straight)
    by_id = {sid: i for i, sid in enumerate(ref.sample_ids)}
    for i in range(0, n, 7):
        got, want = store.sample(i), ref.sample(by_id[store.sample_ids[i]])
        assert all(torch.equal(torch.as_tensor(got[k]), torch.as_tensor(want[k])) for k in want)


def test_error_mid_capture_leaves_only_complete_shards(target, tmp_path, monkeypatch):
    import specdec.capture.run as run_mod

    real, calls = run_mod.forward_padded, {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(*a, **k)

    monkeypatch.setattr(run_mod, "forward_padded", flaky)
    out = tmp_path / "cap"
    with pytest.raises(RuntimeError, match="simulated"):
        capture(target, out, records(8), batch_size=1, shard_tokens=200)
    m = json.loads((out / "manifest.json").read_text())
    files = {p.name for p in out.iterdir() if "shard" in p.name}
    assert files == {sh["file"] for sh in m["shards"]}  # no temp files, no unlisted shards
    monkeypatch.setattr(run_mod, "forward_padded", real)
    capture(target, out, records(8), batch_size=1, shard_tokens=200)
    assert sorted(CaptureStore(out).sample_ids) == sorted(f"s{i}" for i in range(8))


def test_fingerprint_ignores_the_load_dtype_but_not_the_weights(tiny_dirs, tmp_path):
    # `specdec capture --model-dtype bf16` then `specdec train` (target loaded in fp32) is one
    # target; the same folder with one weight changed is another.
    from specdec.models.target import load_target

    bf16 = load_target(str(tiny_dirs["llama"]), device="cpu", dtype="bf16")
    fp32 = load_target(str(tiny_dirs["llama"]), device="cpu", dtype="fp32")
    capture(bf16, tmp_path / "cap", records(2))
    store = CaptureStore(tmp_path / "cap")
    assert store.mismatch_with(fp32) == []
    with torch.no_grad():
        next(fp32.model.parameters()).add_(0.5)
    assert any("fingerprint" in m for m in store.mismatch_with(fp32))


def test_target_fingerprint_ignores_where_the_folder_lies(tiny_dirs, tmp_path):
    """The same weights copied elsewhere (another cache, another machine's transformers writing
    the config) keep their fingerprint, so a capture made there trains here; other weights differ."""
    import shutil

    from specdec.models.target import load_target

    src = tiny_dirs["llama"]
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(src, moved)
    cfg = json.loads((moved / "config.json").read_text())
    cfg["transformers_version"] = "0.0.1"
    (moved / "config.json").write_text(json.dumps(cfg))
    a, b = load_target(str(src)), load_target(str(moved))
    assert a.fingerprint() == b.fingerprint()
    with torch.no_grad():
        next(b.model.parameters()).add_(1.0)
    assert a.fingerprint() != b.fingerprint()


def test_a_broken_data_line_stops_capture_with_its_line_number(tiny_dirs, tmp_path, capsys):
    from specdec.cli import main

    data = tmp_path / "regen.jsonl"
    lines = [json.dumps(r) for r in records(4)]
    lines[2] = lines[2][:-5]
    data.write_text("\n".join(lines) + "\n")
    assert main(["capture", "--target", str(tiny_dirs["llama"]), "--data", str(data), "-o", str(tmp_path / "cap"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "regen.jsonl, line 3: not valid JSON" in err[0]
    assert not (tmp_path / "cap" / "manifest.json").exists()
