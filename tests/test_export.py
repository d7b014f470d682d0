"""specdec export / convert: round trips in both formats, the config keys vLLM, SGLang and
speculators read, and one-line refusals for drafters that must not be served."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.cli import main
from specdec.conventions import from_canonical
from specdec.models.drafter import DrafterConfig, Eagle3Drafter
from specdec.models.formats import load_drafter, save_drafter

def _probe(drafter, seed: int = 0):
    """Logits of two drafting steps on a seeded random input: the target-state path and the
    recycled-hidden path, so every weight and switch takes part."""
    c = drafter.cfg
    g = torch.Generator().manual_seed(seed)
    T = 12
    ids = torch.randint(0, c.vocab_size, (1, T), generator=g)
    aux = torch.randn(1, T, len(c.aux_layer_ids) * c.target_hidden_size, generator=g)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        h, logits0 = drafter(ids, aux, pos)
        _, logits1 = drafter(ids.roll(-1, 1), h, pos + 1)
    return torch.cat([logits0, logits1], 1)


AUX = [2, 3, 4]  # canonical ids, distinct (speculators refuses repeats)
DRAFT_VOCAB = 100


def make_drafter(target, *, seed=0, aux=AUX, **overrides):
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.config, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=aux, **overrides)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name == "embed_tokens.weight":
                continue
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)  # random norms: a swapped norm shows up
        if cfg.vocab_size == target.vocab_size:
            d.embed_tokens.weight.copy_(target.embed_tokens().weight)
    d.set_vocab_mapping(torch.randperm(cfg.vocab_size)[:DRAFT_VOCAB])
    return d.eval()


@pytest.fixture(scope="module")
def target(tiny_targets):
    return tiny_targets["llama"]


@pytest.fixture(scope="module")
def drafter(target):
    return make_drafter(target)


@pytest.fixture(scope="module")
def drafter_dir(drafter, tiny_dirs, tmp_path_factory):
    return save_drafter(drafter, tmp_path_factory.mktemp("drafter"), "eagle3", target_name=str(tiny_dirs["llama"]),
                        dtype=torch.float32)


def cli(argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_refused(rc, err, *needles):
    assert rc != 0
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err  # one line, no traceback
    assert "error:" in lines[0] and "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_export_round_trip_logits_equal(fmt, drafter, drafter_dir, tiny_dirs, target, tmp_path, capsys):
    out = tmp_path / fmt
    rc, stdout, err = cli(["export", "--drafter", drafter_dir, "--target", tiny_dirs["llama"], "--format", fmt,
                           "--dtype", "fp32", "--json", out], capsys)
    assert rc == 0, err
    info = json.loads(stdout)
    assert info["path"] == str(out.resolve()) and info["format"] == fmt
    assert info["validation"]["max_abs_logit_diff"] == 0.0
    reloaded = load_drafter(out, target)
    assert torch.equal(_probe(reloaded), _probe(drafter))
    assert torch.equal(reloaded.d2t, drafter.d2t) and torch.equal(reloaded.t2d, drafter.t2d)
    assert reloaded.cfg.aux_layer_ids == AUX


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_export_bf16_equals_rounded_drafter(fmt, drafter, drafter_dir, target, tmp_path, capsys):
    out = tmp_path / fmt
    rc, _, err = cli(["export", "--drafter", drafter_dir, "--format", fmt, out], capsys)
    assert rc == 0, err
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    rounded = Eagle3Drafter(drafter.cfg)
    rounded.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert torch.equal(_probe(load_drafter(out, target)), _probe(rounded))


def test_eagle3_config_keys(drafter_dir, tiny_dirs, tmp_path, capsys):
    out = tmp_path / "e"
    rc, _, err = cli(["export", "--drafter", drafter_dir, "--target", tiny_dirs["llama"], "--format", "eagle3", out],
                     capsys)
    assert rc == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1 and cfg["model_type"] == "llama"
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["vocab_size"] == 259
    assert cfg["target_hidden_size"] == 64 and cfg["hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX  # vLLM reads the top level, canonical
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # SGLang adds 1 back
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert cfg[flag] is False
    tensors = load_file(str(out / "model.safetensors"))
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"} | {
        f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {
        f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")}
    assert set(tensors) == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * 64  # [embedding, hidden]
    assert tensors["fc.weight"].shape == (64, 3 * 64)


def test_speculators_config_keys(drafter_dir, tiny_dirs, tmp_path, capsys):
    out = tmp_path / "s"
    rc, _, err = cli(["export", "--drafter", drafter_dir, "--target", tiny_dirs["llama"], "--format", "speculators",
                      "--k", "3", out], capsys)
    assert rc == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
    layer = cfg["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["hidden_size"] == 64 and layer["vocab_size"] == 259
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["target_hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert cfg[flag] is False
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"]["name_or_path"] == str(tiny_dirs["llama"].resolve())
    names = set(load_file(str(out / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)


def test_speculators_short_form_only_for_a_hub_verifier(drafter_dir, tiny_dirs, tmp_path, capsys):
    # vLLM 0.34 refuses a local verifier in the short form (transformers_utils/config.py 904-918).
    rc, stdout, _ = cli(["export", "--drafter", drafter_dir, "--target", tiny_dirs["llama"], "--format",
                         "speculators", "--json", tmp_path / "a"], capsys)
    assert rc == 0 and json.loads(stdout)["serve"]["vllm_short"] is None
    rc, stdout, _ = cli(["export", "--drafter", drafter_dir, "--target", tiny_dirs["llama"], "--format",
                         "speculators", "--verifier", "org/tiny-llama", tmp_path / "b"], capsys)
    assert rc == 0 and f"vllm serve {(tmp_path / 'b').resolve()}   (target read" in stdout
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    assert "SGLang 0.5.23:  will not load: SGLang has no Eagle3Speculator" in stdout


def test_no_embeddings_and_serve_commands(drafter_dir, tiny_dirs, target, drafter, tmp_path, capsys):
    out = tmp_path / "noemb"
    rc, stdout, err = cli(["export", "--drafter", drafter_dir, "--target", tiny_dirs["llama"], "--no-embeddings",
                           "--dtype", "fp32", "--json", out], capsys)
    assert rc == 0, err
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    info = json.loads(stdout)
    tgt = str(tiny_dirs["llama"].resolve())
    assert info["serve"]["vllm"] == (
        f"vllm serve {tgt} --speculative-config "
        f"'{{\"method\":\"eagle3\",\"model\":\"{out.resolve()}\",\"num_speculative_tokens\":5}}'"
    )
    assert info["serve"]["sglang"] == (
        f"python -m sglang.launch_server --model-path {tgt} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {out.resolve()} --speculative-num-steps 5 --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens 6"
    )
    ids = info["aux_layer_ids"]
    assert ids["canonical"] == ids["vllm"] == ids["speculators"] == AUX
    assert ids["specforge"] == ids["modelopt"] == from_canonical(AUX, "specforge") == [1, 2, 3]
    assert ids["sglang"] == [1, 2, 3]
    assert info["warnings"] == []
    # The embedding comes back from the target.
    assert torch.equal(_probe(load_drafter(out, target)), _probe(drafter))


def test_human_output_names_every_convention(drafter_dir, tiny_dirs, tmp_path, capsys):
    rc, stdout, _ = cli(["export", "--drafter", drafter_dir, "--target", tiny_dirs["llama"], tmp_path / "h"], capsys)
    assert rc == 0
    assert "vllm serve" in stdout and "--speculative-algorithm EAGLE3" in stdout
    assert "[2, 3, 4]" in stdout and "[1, 2, 3]" in stdout and "logits equal" in stdout


def test_per_engine_verdicts_and_for_exit_code(target, tmp_path, capsys):
    """Canonical id 4 is the 4-layer target's last output: vLLM captures it (llama.py 437-441),
    SGLang captures only layer inputs 0..L-1 (srt/models/llama.py 485-494). `--for` turns that
    into the exit status; `--json` carries the same verdicts."""
    src = save_drafter(make_drafter(target, aux=[1, 2, 4]), tmp_path / "d", "eagle3", dtype=torch.float32)
    rc, stdout, _ = cli(["export", "--drafter", src, "--json", "--for", "vllm", tmp_path / "o"], capsys)
    assert rc == 0
    engines = json.loads(stdout)["engines"]
    assert engines["vllm"]["ok"] and engines["vllm"]["fed_ids"] == [1, 2, 4]
    assert engines["vllm"]["max_abs_logit_diff"] == 0.0
    assert not engines["sglang"]["ok"] and "never fed" in engines["sglang"]["verdict"]
    rc, stdout, _ = cli(["export", "--drafter", src, "--for", "sglang", "--force", tmp_path / "o2"], capsys)
    assert rc == 1
    assert "vLLM 0.34.0:" in stdout and "loads; feeds hidden_states[1, 2, 4] = trained on [1, 2, 4]" in stdout
    assert "SGLang 0.5.23:" in stdout and "will not load" in stdout


# ---------------------------------------------------------------------------------------------
# Refusals: one line, non-zero exit, nothing served


def test_refuses_missing_path(tmp_path, capsys):
    rc, _, err = cli(["export", "--drafter", tmp_path / "nope", tmp_path / "o"], capsys)
    assert_refused(rc, err, "no drafter at")


def test_refuses_truncated_safetensors(drafter_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(drafter_dir, bad)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    rc, _, err = cli(["export", "--drafter", bad, tmp_path / "o"], capsys)
    assert_refused(rc, err, "truncated or corrupt")
    assert not (tmp_path / "o" / "config.json").exists()


@pytest.mark.parametrize("override,needle", [
    ({"target_hidden_size": 32}, "expects target hidden size 32"),
    ({"vocab_size": 300}, "has vocab size 300"),
])
def test_refuses_drafter_for_another_target(override, needle, target, tiny_dirs, tmp_path, capsys):
    other = make_drafter(target, **override)
    src = save_drafter(other, tmp_path / "other", "eagle3", dtype=torch.float32)
    rc, _, err = cli(["export", "--drafter", src, "--target", tiny_dirs["llama"], tmp_path / "o"], capsys)
    assert_refused(rc, err, needle, "another target")


@pytest.mark.parametrize("config", ["[1, 2]", '{"architectures": ["LlamaForCausalLMEagle3"]}',
                                    '{"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": "big", '
                                    '"intermediate_size": 8, "num_attention_heads": 2, "vocab_size": 9}'])
def test_refuses_broken_config_in_one_line(config, drafter_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(drafter_dir, bad)
    (bad / "config.json").write_text(config)
    rc, _, err = cli(["export", "--drafter", bad, tmp_path / "o"], capsys)
    assert_refused(rc, err, "config")


def test_refuses_missing_d2t(drafter_dir, tmp_path, capsys):
    bad = tmp_path / "nod2t"
    shutil.copytree(drafter_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(bad / "model.safetensors"))
    rc, _, err = cli(["export", "--drafter", bad, tmp_path / "o"], capsys)
    assert_refused(rc, err, "no d2t")


def test_refuses_d2t_out_of_range(drafter_dir, tiny_dirs, tmp_path, capsys):
    bad = tmp_path / "badd2t"
    shutil.copytree(drafter_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["d2t"][-1] = 10_000
    save_file(tensors, str(bad / "model.safetensors"))
    rc, _, err = cli(["export", "--drafter", bad, "--target", tiny_dirs["llama"], tmp_path / "o"], capsys)
    assert_refused(rc, err, "outside the target vocab")


def test_refuses_stale_weights_in_out(drafter_dir, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"x")
    rc, _, err = cli(["export", "--drafter", drafter_dir, out], capsys)
    assert_refused(rc, err, "--force")
    rc, _, err = cli(["export", "--drafter", drafter_dir, "--force", out], capsys)
    assert rc == 0, err
    assert not (out / "model-00001-of-00002.safetensors").exists()


def test_python_m_specdec_refusal_exit_code(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "specdec", "export", "--drafter", str(tmp_path / "nope"),
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no drafter at" in r.stderr


# ---------------------------------------------------------------------------------------------
# convert


def _foreign(drafter_dir, dest, *, prefix="", drop=(), config_update=None, config_drop=()):
    """A copy of our eagle3 export dressed as another tool's checkpoint."""
    dest.mkdir(parents=True)
    tensors = load_file(str(drafter_dir / "model.safetensors"))
    tensors = {(k if k in ("d2t", "t2d") else prefix + k): v for k, v in tensors.items() if k not in drop}
    save_file(tensors, str(dest / "model.safetensors"))
    cfg = json.loads((drafter_dir / "config.json").read_text())
    for k in ("specdec", "eagle_aux_hidden_state_layer_ids", "eagle_config", "target_hidden_size", *config_drop):
        cfg.pop(k, None)
    cfg.update(config_update or {})
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def test_convert_specforge(drafter, drafter_dir, tiny_dirs, target, tmp_path, capsys):
    # SpecForge: embeddings dropped, wrapper prefix, ids only in eagle_config, read as SGLang reads
    # them for a llama target (always +1).
    src = _foreign(drafter_dir, tmp_path / "sf", prefix="model.", drop=("embed_tokens.weight",),
                   config_update={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}})
    rc, stdout, err = cli(["convert", src, tmp_path / "out", "--target", tiny_dirs["llama"], "--dtype", "fp32",
                           "--json"], capsys)
    assert rc == 0, err
    info = json.loads(stdout)
    assert info["source_format"] == "specforge" and info["source_layer_convention"] == "sglang"
    assert "SGLang's rule for llama" in info["aux_layer_ids_how"]
    assert info["aux_layer_ids"]["canonical"] == AUX
    converted = load_drafter(tmp_path / "out", target)
    assert converted.cfg.aux_layer_ids == AUX
    assert torch.equal(_probe(converted), _probe(drafter))


def test_convert_layer_convention_override(drafter_dir, tiny_dirs, tmp_path, capsys):
    src = _foreign(drafter_dir, tmp_path / "sf",
                   config_update={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}})
    rc, stdout, err = cli(["convert", src, tmp_path / "out", "--layer-convention", "vllm", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(stdout)["aux_layer_ids"]["canonical"] == AUX


def test_convert_eagle_reference_needs_ids_or_target(drafter, drafter_dir, tiny_dirs, target, tmp_path, capsys):
    src = _foreign(drafter_dir, tmp_path / "ea", drop=("t2d",))
    rc, _, err = cli(["convert", src, tmp_path / "o1", "--from", "eagle"], capsys)
    assert_refused(rc, err, "names no aux layer ids")
    rc, stdout, err = cli(["convert", src, tmp_path / "o2", "--from", "eagle", "--aux-layer-ids", "2,3,4",
                           "--target", tiny_dirs["llama"], "--dtype", "fp32", "--json"], capsys)
    assert rc == 0, err
    assert torch.equal(_probe(load_drafter(tmp_path / "o2", target)), _probe(drafter))


def test_convert_speculators_to_eagle3(drafter, drafter_dir, tiny_dirs, target, tmp_path, capsys):
    spec = save_drafter(drafter, tmp_path / "spec", "speculators", target_name=str(tiny_dirs["llama"]),
                        dtype=torch.float32)
    cfg = json.loads((spec / "config.json").read_text())
    del cfg["specdec"]  # as speculators itself writes it
    (spec / "config.json").write_text(json.dumps(cfg))
    rc, stdout, err = cli(["convert", spec, tmp_path / "out", "--format", "eagle3", "--dtype", "fp32", "--json"],
                          capsys)
    assert rc == 0, err
    assert json.loads(stdout)["source_format"] == "speculators"
    assert torch.equal(_probe(load_drafter(tmp_path / "out", target)), _probe(drafter))


def test_convert_refuses_pickles_without_opening_them(tmp_path, capsys):
    src = tmp_path / "bin"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (src / "pytorch_model.bin").write_bytes(b"not a pickle at all")  # unpickling would raise differently
    rc, _, err = cli(["convert", src, tmp_path / "o"], capsys)
    assert_refused(rc, err, "pytorch_model.bin", "safetensors", "trust")
    rc, _, err = cli(["convert", src / "pytorch_model.bin", tmp_path / "o"], capsys)
    assert_refused(rc, err, "pickle", "safetensors")


def test_a_target_whose_weights_are_pickles_is_refused_without_opening_them(tiny_dirs, tmp_path, capsys):
    import shutil

    src = tmp_path / "target"
    shutil.copytree(tiny_dirs["llama"], src)
    for f in src.glob("*.safetensors"):
        f.unlink()
    (src / "pytorch_model.bin").write_bytes(b"not a pickle at all")  # unpickling would raise differently
    rc, _, err = cli(["generate", "--target", src, "--prompt", "hi", "--max-new-tokens", "2"], capsys)
    assert_refused(rc, err, "pytorch_model.bin", "pickle", "safetensors")


def test_convert_refuses_reduced_vocab_without_mapping(drafter_dir, tmp_path, capsys):
    src = _foreign(drafter_dir, tmp_path / "nomap", drop=("d2t", "t2d"))
    rc, _, err = cli(["convert", src, tmp_path / "o", "--aux-layer-ids", "2,3,4"], capsys)
    assert_refused(rc, err, "no d2t or t2d")


def test_convert_rebuilds_d2t_from_t2d(drafter, drafter_dir, target, tmp_path, capsys):
    src = _foreign(drafter_dir, tmp_path / "t2donly", drop=("d2t",))
    rc, stdout, err = cli(["convert", src, tmp_path / "o", "--aux-layer-ids", "2,3,4", "--json"], capsys)
    assert rc == 0, err
    assert any("rebuilt from t2d" in n for n in json.loads(stdout)["notes"])
    assert torch.equal(load_drafter(tmp_path / "o", target).d2t, drafter.d2t)


def test_convert_refuses_multilayer_and_unknown(drafter_dir, tmp_path, capsys):
    src = _foreign(drafter_dir, tmp_path / "ml")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["layers.1.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(src / "model.safetensors"))
    rc, _, err = cli(["convert", src, tmp_path / "o", "--aux-layer-ids", "2,3,4"], capsys)
    assert_refused(rc, err, "more than one decoder layer")


def test_help_shows_examples(capsys):
    for cmd in ("export", "convert", "eval"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert "examples:" in capsys.readouterr().out
