"""`specdec doctor` on a drafter broken on purpose, one fault at a time: static faults in the
folder, and integration faults in a real `specdec serve` process (--fault) found with --server.

The drafter is a tiny-llama quickstart's (a few seconds on a CPU; it accepts ~2 tokens per step
on its own training prompts), so every fault has something to collapse."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.cli import main
from specdec.server.launch import ServerProcess

ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def run(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("qs")
    r = subprocess.run([sys.executable, "-m", "specdec", "quickstart", "--target", str(tiny_dirs["llama"]),
                        "--prompts", "48", "--eval-prompts", "2", "--max-new-tokens", "32", "--tree-depth", "0",
                        "--draft-vocab-size", "160", "--out", str(out)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, **ENV})
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def doctor(argv, capsys):
    rc = main(["doctor", "--engine", "vllm", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def broken_copy(run, tmp_path, *, config=None, tensors=None):
    dst = tmp_path / "drafter"
    shutil.copytree(run / "train" / "drafter", dst)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors:
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"))
    return dst


def checks_of(stdout):
    return {c["name"]: c for c in json.loads(stdout)["checks"]}


def test_healthy_drafter_is_healthy(run, tiny_dirs, capsys):
    rc, out, err = doctor(["--target", tiny_dirs["llama"], "--drafter", run / "train" / "drafter", "--prompts",
                           run / "regen.jsonl", "--max-new-tokens", "32", "--json"], capsys)
    data = json.loads(out)
    assert rc == 0, data["verdict"]
    assert all(c["status"] != "fail" for c in data["checks"])
    assert data["verdict"].startswith("healthy") and set(data) >= {"checks", "sweep", "reference", "recommendation"}
    # The sweep says which faults this target cannot show.
    rows = data["sweep"]["rows"][1:]
    assert all(isinstance(r["changes_acceptance"], bool) for r in rows)
    blind = [r["hypothesis"] for r in rows if not r["changes_acceptance"]]
    assert data["sweep"]["insensitive"] == blind
    assert all(h in data["verdict"] for h in blind)


def test_lost_d2t_is_named_and_convert_rebuilds_it(run, tiny_dirs, tmp_path, capsys):
    def zero(t):
        t["d2t"] = torch.zeros_like(t["d2t"])

    bad = broken_copy(run, tmp_path, tensors=zero)
    rc, out, _ = doctor(["--target", tiny_dirs["llama"], "--drafter", bad, "--checks-only", "--json"], capsys)
    assert rc == 1
    c = checks_of(out)["vocab mapping"]
    assert c["status"] == "fail" and "mapping is lost" in c["detail"] and "rebuilds d2t from t2d" in c["fix"]
    assert main(["convert", str(bad), str(tmp_path / "fixed"), "--target", str(tiny_dirs["llama"])]) == 0
    capsys.readouterr()
    fixed = load_file(str(tmp_path / "fixed" / "model.safetensors"))["d2t"]
    assert torch.equal(fixed, load_file(str(run / "train" / "drafter" / "model.safetensors"))["d2t"])


def test_scaled_fc_is_named(run, tiny_dirs, tmp_path, capsys):
    def scale(t):
        t["fc.weight"] = t["fc.weight"] * 50

    bad = broken_copy(run, tmp_path, tensors=scale)
    rc, out, _ = doctor(["--target", tiny_dirs["llama"], "--drafter", bad, "--checks-only", "--json"], capsys)
    c = checks_of(out)["drafter weights"]
    assert rc == 1 and c["status"] == "fail" and "fc.weight is 50x" in c["detail"]


def test_engine_keys_that_disagree_with_training_are_named(run, tiny_dirs, tmp_path, capsys):
    def shift(raw):
        raw["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in raw["eagle_aux_hidden_state_layer_ids"]]

    bad = broken_copy(run, tmp_path, config=shift)
    rc, out, _ = doctor(["--target", tiny_dirs["llama"], "--drafter", bad, "--checks-only", "--json"], capsys)
    c = checks_of(out)["vLLM 0.34.0 reading"]
    assert rc == 1 and c["status"] == "fail" and "but the drafter was trained on [1, 2, 4]" in c["detail"]


def test_changed_chat_template_is_named(run, tiny_dirs, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(tiny_dirs["llama"], target)
    template = target / "chat_template.jinja"
    template.write_text("SYSTEM: be brief\n" + template.read_text())
    rc, out, _ = doctor(["--target", target, "--drafter", run / "train" / "drafter", "--checks-only", "--json"],
                        capsys)
    c = checks_of(out)["chat template and tokenizer"]
    assert rc == 1 and c["status"] == "fail" and "changed since training" in c["detail"]


def test_flipped_norm_flag_is_named_by_the_sweep(run, tiny_dirs, tmp_path, capsys):
    def flip(raw):
        raw["norm_before_residual"] = not raw["norm_before_residual"]
        raw["specdec"].pop("provenance")  # an edit no weight norm or fingerprint can see

    bad = broken_copy(run, tmp_path, config=flip)
    rc, out, _ = doctor(["--target", tiny_dirs["llama"], "--drafter", bad, "--prompts", run / "regen.jsonl",
                         "--limit", "4", "--max-new-tokens", "32", "--json"], capsys)
    data = json.loads(out)
    assert rc == 1 and data["sweep"]["mismatch"] == "norm_before_residual flipped", data["verdict"]
    assert "norm_before_residual to the other value" in data["recommendation"]


def test_changed_target_weights_show_in_the_state_check(run, tiny_dirs, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(tiny_dirs["llama"], target)
    w = load_file(str(target / "model.safetensors"))
    w = {k: v * 1.5 if k.startswith("model.layers.1.mlp.") else v for k, v in w.items()}
    save_file(w, str(target / "model.safetensors"), metadata={"format": "pt"})
    rc, out, _ = doctor(["--target", target, "--drafter", run / "train" / "drafter", "--prompts",
                         run / "regen.jsonl", "--limit", "1", "--max-new-tokens", "8", "--json"], capsys)
    data = json.loads(out)
    checks = checks_of(out)
    assert checks["target weights"]["status"] == "warn"
    states = checks["hidden states vs training capture"]
    assert rc == 1 and states["status"] == "fail" and "ids [2, 4]" in states["detail"]
    assert data["states"]["relative_error"]["1"] < 0.05  # layer 1's input is untouched


def test_drafter_for_another_target_is_named(run, tiny_dirs, capsys):
    # Same shapes, another architecture: it loads, and it is still the wrong target.
    rc, out, _ = doctor(["--target", tiny_dirs["qwen2"], "--drafter", run / "train" / "drafter", "--checks-only",
                         "--json"], capsys)
    assert rc == 1
    assert "qwen2" in json.loads(out)["verdict"] or "another target" in json.loads(out)["verdict"]
    # Loading it to generate says so too, before it runs.
    rc = main(["generate", "--target", str(tiny_dirs["qwen2"]), "--drafter", str(run / "train" / "drafter"),
               "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 0 and "trained for a llama target" in err and "is a qwen2" in err


@pytest.mark.parametrize("fault,named", [("aux-ids=0,1,2", "integration"), ("zero-aux=2", "integration"),
                                          (None, "healthy")])
def test_server_faults_are_found_live(run, tiny_dirs, fault, named, capsys):
    args = ["--target", str(tiny_dirs["llama"]), "--drafter", str(run / "train" / "drafter"),
            "--num-speculative-tokens", "5"] + (["--fault", fault] if fault else [])
    with ServerProcess(args, env=ENV) as server:
        if fault:
            assert "FAULT INJECTED" in server.output
        rc, out, _ = doctor(["--target", tiny_dirs["llama"], "--drafter", run / "train" / "drafter", "--server",
                             server.url, "--prompts", run / "regen.jsonl", "--json"], capsys)
    data = json.loads(out)
    assert data["verdict"].startswith(named), data["verdict"]
    assert rc == (0 if named == "healthy" else 1)
    if fault:
        assert data["comparison"]["positions"][0]["live_below_reference"]
        assert data["sweep"]["match"] is not None and data["recommendation"]
    else:  # the same engine, greedy: exactly the reference's counts
        assert data["live"]["per_position_acceptance"] == pytest.approx(data["reference"]["per_position_acceptance"])


def test_bad_fault_is_refused_before_loading(capsys):
    assert main(["serve", "--target", "tiny-llama", "--ngram", "3", "--fault", "shift=1"]) == 2
    assert "expected aux-ids=2,16,28 or zero-aux=SLOT" in capsys.readouterr().err


def test_every_switch_walked_on_the_reference_text_counts_what_the_engine_counts(run, tiny_dirs):
    """The sweep's fast path: each hypothesis measured on the reference's own text gives, step by
    step, the drafts the engine accepts when it generates under that switch; and every switch is
    undone afterwards."""
    from contextlib import nullcontext

    from specdec.data.datasets import load_conversations
    from specdec.doctor.sweep import HYPOTHESES, Reference, Sweep, switched
    from specdec.engine.api import SamplingParams
    from specdec.engine.engine import SpeculativeEngine
    from specdec.models.formats import load_drafter
    from specdec.models.target import load_target

    target = load_target(str(tiny_dirs["llama"]), device="cpu")
    drafter = load_drafter(run / "train" / "drafter", target)
    before = ({k: v.clone() for k, v in drafter.state_dict().items()}, list(drafter.cfg.aux_layer_ids),
              drafter.cfg.norm_before_residual, target.last_state)
    k, params = 4, SamplingParams(max_new_tokens=24)
    reference = Reference(target, drafter, k=k, max_tokens=24)
    for conv in load_conversations(str(run / "regen.jsonl"), limit=3, seed=0):
        reference.add(conv)
    sweep = Sweep(target, drafter, k)
    for text in reference.texts:
        sweep.add(text)
    assert len(sweep.walks) >= 6  # the ids shifts, norm flag, d2t, the zeroed states at least
    moved = 0
    for name, walks in sweep.walks.items():
        h = next((h for h in HYPOTHESES if h.name == name), None)
        with switched(h, target, drafter) if h else nullcontext():
            engine = SpeculativeEngine(target, drafter=drafter, k=k)  # reads the ids as switched
            for text, walk in zip(reference.texts, walks):
                prompt = text.ids[: text.prompt_len].tolist()
                steps = list(engine.generate_iter(prompt, params))
                assert [t for s in steps for t in s.token_ids] == text.ids[text.prompt_len:].tolist()  # lossless
                # The engine's last step is cut at max_new_tokens; the walk ends with the text.
                accepted = [min(s.accepted, len(s.token_ids) - 1) for s in steps if s.drafted]
                assert accepted == walk.accepted, name
        target.set_aux_layer_ids(drafter.cfg.aux_layer_ids)
        moved += [w.accepted for w in walks] != [w.accepted for w in sweep.walks["as configured"]]
    assert moved >= 3  # the comparison is not between identical figures
    assert all(torch.equal(v, before[0][n]) for n, v in drafter.state_dict().items())
    assert (list(drafter.cfg.aux_layer_ids), drafter.cfg.norm_before_residual, target.last_state) == before[1:]
